"""HTTP pieces every framework adapter shares: no I/O and no framework imports.

The ASGI (`idempo.asgi`), WSGI (`idempo.wsgi`) and Django (`idempo.contrib.django`)
middlewares are built on them, so the contract has one implementation.
They turn a request into a key, a principal and a fingerprint, a response into a stored
record and back, and idempo's refusals into RFC 9457 problem responses::

    key = parse_key(header_values(headers, b"idempotency-key"))   # None when absent
    payload = canonical_request(HttpRequest(method, path, query, headers, body))
    async with idem.once(key, operation=op, payload=payload, codec=HttpCodec()) as attempt:
        ...
"""

from __future__ import annotations

import hashlib
import json
import json.encoder
import logging
import math
import shlex
import uuid
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

from ._core.fingerprint import canonical_bytes
from ._core.keys import Scope, validate_key
from ._core.record import Record, Status
from .errors import (
    ConfigurationError,
    CorruptRecordError,
    FencedError,
    FingerprintMismatchError,
    IdempotencyError,
    InvalidKeyError,
    InvalidPayloadError,
    MissingKeyError,
    PrincipalRequiredError,
    RequestInProgressError,
    RequestTooLargeError,
    SchemaMissingError,
    StoreError,
)
from .policy import Policy

__all__ = [
    "DEFAULT_BODY_LIMIT",
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
    "check_options",
    "classify_status",
    "decode_response",
    "default_principal",
    "encode_response",
    "evict_hint",
    "header_values",
    "headers_named",
    "http_policy",
    "parse_key",
    "problem",
    "problem_for",
    "request_fingerprint",
    "user_principal",
]

Header = tuple[bytes, bytes]
"""One header as it travels in ASGI: ``(name, value)``, both bytes, the name lowercased."""

logger = logging.getLogger("idempo.http")

KEY_HEADER = b"idempotency-key"
REPLAYED_HEADER = b"idempotent-replayed"

# Problem types are URNs: stable identifiers that promise no web page (RFC 9457 §3.1.1
# allows non-resolvable type URIs). docs/http.md lists them.
PROBLEM_TYPE_BASE = "urn:idempo:problem:"

# RFC 9110 §7.6.1 hop-by-hop fields, plus the obsolete ones proxies still send. A replay
# travels over a new connection, so the first connection's fields mean nothing there.
_HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
# A session cookie set for the first caller must not be handed to whoever replays, nor kept
# in the store at all.
_PRIVATE = frozenset({b"set-cookie"})
_NOT_SHAREABLE = _HOP_BY_HOP | _PRIVATE
_NOT_REPLAYED = _NOT_SHAREABLE | {REPLAYED_HEADER}

_STORED_FORMAT_VERSION = 1

# A string as a JSON literal with ASCII escapes: what json.dumps writes with ensure_ascii.
_ascii_string: Callable[[str], str] = json.encoder.encode_basestring_ascii

DEFAULT_BODY_LIMIT = 1024 * 1024
# Room for the status and headers in a stored record, on top of the body limit.
_HEAD_ROOM = 64 * 1024


# --- middleware options -------------------------------------------------------------------


def check_options(
    *,
    max_request_bytes: int,
    max_response_bytes: int,
    max_retry_after: int,
    store_retry_after: int,
    fingerprint_fields: Collection[str],
) -> None:
    """Refuse impossible middleware options when the middleware is made, not per request.

    Raises:
        ConfigurationError: a negative size limit, a Retry-After under 1 s, or an unknown
            fingerprint field.
    """
    if max_request_bytes < 0 or max_response_bytes < 0:
        raise ConfigurationError("max_request_bytes and max_response_bytes cannot be negative")
    if max_retry_after < 1 or store_retry_after < 1:
        raise ConfigurationError("Retry-After values are whole seconds, at least 1")
    unknown = set(fingerprint_fields) - set(DEFAULT_FINGERPRINT_FIELDS)
    if unknown:
        raise ConfigurationError(f"unknown fingerprint fields: {sorted(unknown)}")


def http_policy(
    policy: Policy | None, lease: float | timedelta | None, max_response_bytes: int
) -> Policy:
    """The policy a middleware's own guard runs with (``store=``, not a shared guard).

    ``lease`` overrides the policy's. The policy limits the stored bytes (status and headers
    included) while the middleware's limit is on the body, so the policy is raised to leave
    room for a body at that limit.

    >>> http_policy(None, 10, 1024).lease
    datetime.timedelta(seconds=10)
    """
    policy = policy or Policy()
    if lease is not None:
        policy = policy.replace(
            lease=lease if isinstance(lease, timedelta) else timedelta(seconds=lease)
        )
    room = max_response_bytes + _HEAD_ROOM
    if policy.max_response_bytes < room:
        policy = policy.replace(max_response_bytes=room)
    return policy


# --- the key ------------------------------------------------------------------------------


def header_values(headers: Iterable[Header], name: bytes) -> list[bytes]:
    """Every value of header ``name`` (lowercase), in order."""
    # lower() keeps a name's length: comparing lengths first spares lowering the others.
    size = len(name)
    return [value for key, value in headers if len(key) == size and key.lower() == name]


def headers_named(headers: Iterable[Header], names: Collection[bytes]) -> dict[bytes, list[bytes]]:
    """Every value of each header in ``names`` (lowercase), in order, found in one pass.

    >>> headers_named([(b"Content-Length", b"2"), (b"host", b"x")], {b"content-length"})
    {b'content-length': [b'2']}
    """
    found: dict[bytes, list[bytes]] = {}
    for name, value in headers:
        lowered = name.lower()
        if lowered in names:
            if lowered in found:
                found[lowered].append(value)
            else:
                found[lowered] = [value]
    return found


def parse_key(values: Sequence[bytes]) -> str | None:
    """The idempotency key in the ``Idempotency-Key`` header values, or None when absent.

    A value is a bare token or an RFC 8941 sf-string; ``abc`` and ``"abc"`` name the same
    key. A value that starts with ``"`` but is not a valid sf-string is malformed; so is a
    header sent twice (which value would be the key?). Parameters on an sf-string are
    ignored, as RFC 8941 asks of unknown parameters.

    Raises:
        InvalidKeyError: the header is malformed or the key is not 1-255 printable ASCII.

    >>> parse_key([b'"order-42"']), parse_key([b"order-42"]), parse_key([])
    ('order-42', 'order-42', None)
    """
    if not values:
        return None
    if len(values) > 1:
        raise InvalidKeyError("the Idempotency-Key header appears more than once")
    # Optional whitespace around a field value is not part of it (RFC 9110 §5.5).
    raw = values[0].strip(b" \t")
    if raw.startswith(b'"'):
        return validate_key(_sf_string(raw))
    return validate_key(raw.decode("latin-1"))


def _sf_string(raw: bytes) -> str:
    # Imported here so that idempo itself needs http-sf only where HTTP is used.
    try:
        import http_sf  # noqa: PLC0415 - optional dependency (idempo[asgi])
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        from .errors import ConfigurationError  # noqa: PLC0415

        raise ConfigurationError(
            "quoted Idempotency-Key values need http-sf: pip install 'idempo[asgi]'"
        ) from exc
    try:
        item = http_sf.parse(raw, tltype="item")
    except (http_sf.StructuredFieldError, ValueError) as exc:
        raise InvalidKeyError(f"the Idempotency-Key is not a valid sf-string: {exc}") from exc
    value = item[0] if isinstance(item, tuple) else item
    if not isinstance(value, str):
        raise InvalidKeyError("a quoted Idempotency-Key must be an sf-string")
    return value


def default_principal(authorization: Sequence[bytes]) -> str:
    """Who asked, by the Authorization header: its hex SHA-256, ``""`` (anonymous) without one.

    The raw credential is never stored.

    >>> default_principal([]), default_principal([b"Bearer t"])[:12]
    ('', '63a25a26464c')
    """
    if not authorization:
        return ""
    return hashlib.sha256(b"\n".join(authorization)).hexdigest()


# Where a user object keeps its id, in the order asked: Starlette's BaseUser.identity,
# Django's pk, then the names apps' own user classes (Litestar's are the app's) use most.
# Flask-Login's get_id() is asked before all of them. Not display names: two users may
# share one.
_USER_ID_NAMES = ("identity", "pk", "id", "user_id", "sub", "username", "email")


def _user_id(user: Any) -> str | None:
    if isinstance(user, bool):
        return None
    if isinstance(user, str | int | uuid.UUID):
        return str(user) or None
    candidates: list[Any] = []
    get_id = getattr(user, "get_id", None)
    if callable(get_id):
        candidates.append(get_id())
    for name in _USER_ID_NAMES:
        if isinstance(user, Mapping):
            candidates.append(user.get(name))
            continue
        try:
            candidates.append(getattr(user, name, None))
        except NotImplementedError:  # Starlette's BaseUser.identity, left to subclasses
            continue
    for value in candidates:
        if isinstance(value, str | int | uuid.UUID) and not isinstance(value, bool) and str(value):
            return str(value)
    return None


def user_principal(user: Any) -> str | None:
    """``"user:<id>"`` for a user the framework authenticated, None for no user or an
    anonymous one (``is_authenticated`` false).

    The id is the user's own (Flask-Login's ``get_id()``, Starlette's ``identity``, Django's
    ``pk``, or an ``id``/``username``/... attribute or key), never its class: renaming a user
    class between a request and its retry must not make the retry another principal.

    Raises:
        ConfigurationError: the user is authenticated but has none of those ids. Falling back
            to a principal shared by every such user would hand one user another's answer.

    >>> class User:
    ...     is_authenticated = True
    ...     pk = 42
    >>> user_principal(User()), user_principal(None)
    ('user:42', None)
    """
    if user is None:
        return None
    authenticated = getattr(user, "is_authenticated", True)
    if callable(authenticated):  # old Django and Flask-Login made it a method
        authenticated = authenticated()
    if not authenticated:
        return None
    found = _user_id(user)
    if found is None:
        raise ConfigurationError(
            f"idempo cannot tell which user a {type(user).__name__} is (no get_id(), "
            f"{', '.join(_USER_ID_NAMES)}): pass principal= to the idempotency middleware"
        )
    return f"user:{found}"


class _NoResolver:
    def __repr__(self) -> str:
        return "NO_RESOLVER"


NO_RESOLVER: Any = _NoResolver()
"""What `Principals.resolve` is given when the app passed no ``principal=`` resolver."""


class Principals:
    """Who asked, for one middleware (SPEC §1).

    The app's resolver wins: a string is the principal (``""``: anonymous, by the app's own
    choice); None means it could not tell, and the request is refused with
    `PrincipalRequiredError` (401) unless ``allow_anonymous``, when the default applies.
    The default, without a resolver: the user the framework authenticated, else the SHA-256
    of ``Authorization``, else anonymous. An anonymous request that carries cookies is most
    likely a signed-in user of a cookie-session app idempo cannot see; the first one is
    logged as a warning (once per middleware), since anonymous callers share one key space.

    Args:
        allow_anonymous: anonymous callers are expected: a resolver's None falls back to the
            default instead of a 401, and cookies on an anonymous request are not warned of.
        owner: the middleware's name, for the warning.
    """

    def __init__(self, *, allow_anonymous: bool, owner: str) -> None:
        self.allow_anonymous = allow_anonymous
        self.owner = owner
        self._warned = False

    def resolve(
        self,
        chosen: str | None,
        user: Callable[[], Any],
        authorization: Sequence[bytes],
        cookies: bool,
    ) -> str:
        """The principal of one request.

        Args:
            chosen: what the app's resolver returned, or `NO_RESOLVER`.
            user: reads the user the framework authenticated (None when it cannot see one);
                called only when the default is needed.
            authorization: the request's Authorization values.
            cookies: whether the request carries a Cookie header.

        Raises:
            PrincipalRequiredError: the resolver returned None and anonymous is not allowed.
            ConfigurationError: see `user_principal`.
        """
        if isinstance(chosen, str):
            return chosen
        if chosen is None and not self.allow_anonymous:
            raise PrincipalRequiredError(
                "the principal resolver could not tell who sent this request, and this "
                "endpoint does not take anonymous requests"
            )
        found = user_principal(user())
        if found is not None:
            return found
        if authorization:
            return default_principal(authorization)
        if cookies and not self.allow_anonymous and not self._warned:
            self._warned = True
            logger.warning(
                "idempo: %s saw a request with cookies but no principal (no authenticated "
                "user it can see, no Authorization header), so it ran as anonymous, and "
                "anonymous callers share one key space. A cookie-session app must pass "
                "principal= (the signed-in user's id); allow_anonymous=True silences this. "
                "Said once.",
                self.owner,
            )
        return ""


# --- the fingerprint ----------------------------------------------------------------------

FingerprintField = Literal["method", "path", "query", "body"]
DEFAULT_FINGERPRINT_FIELDS: tuple[FingerprintField, ...] = ("method", "path", "query", "body")


@dataclass(frozen=True, slots=True)
class HttpRequest:
    """What a fingerprint can be made of, whatever the framework."""

    method: str
    path: str
    query: bytes
    headers: Sequence[Header]
    body: bytes


def _is_json(content_type: bytes) -> bool:
    media = content_type.split(b";", 1)[0].strip().lower()
    return media == b"application/json" or (
        media.startswith(b"application/") and media.endswith(b"+json")
    )


def _canonical_body(body: bytes, content_type: bytes) -> bytes:
    """RFC 8785 bytes for a JSON body, so ``{"a": 1}`` and ``{ "a":1 }`` are one request;
    other bodies as sent, and so is JSON that does not parse or has no RFC 8785 form (invalid
    UTF-8, a lone surrogate, ``1e400``, an integer over 4,300 digits, nesting deeper than
    Python's parser goes): the app refuses or reads those itself, and raw bytes only ever
    make two requests differ, never alike.

    A parsed document is canonicalised at any depth (`canonical_bytes` does not recurse).
    """
    if not body or not _is_json(content_type):
        return body
    try:
        return canonical_bytes(_json_loads(body))
    except (ValueError, InvalidPayloadError, RecursionError):
        return body


_DECODER = json.JSONDecoder()


def _json_loads(data: bytes) -> Any:
    """``json.loads(data)``, with less work for the usual document: UTF-8 (json.loads's
    encoding detection picks it for any document that starts with ``{`` or ``[`` followed by
    a non-NUL byte) and nothing after it. Anything else takes json.loads itself."""
    first = data[:1]
    if first in (b"{", b"[") and data[1:2] != b"\x00":
        try:
            text = data.decode("utf-8", "surrogatepass")
            value, end = _DECODER.raw_decode(text)
        except ValueError:
            pass  # json.loads raises its own error below
        else:
            if end == len(text):
                return value
    return json.loads(data)


def canonical_request(
    request: HttpRequest,
    *,
    fields: Collection[FingerprintField] = DEFAULT_FINGERPRINT_FIELDS,
    headers: Collection[str] = (),
) -> bytes:
    """The canonical bytes of a request: what its fingerprint is the SHA-256 of.

    A JSON document naming each part (sorted keys, ASCII escapes: one spelling per request),
    so no two requests' parts can run together. Only the body needs RFC 8785, which the
    document holds as the SHA-256 of the body's canonical form; the envelope is plain strings
    (json.dumps's bytes). ``headers`` names the request headers that count too
    (case-insensitive; all their values, in order).

    >>> json_type = [(b"content-type", b"application/json")]
    >>> a = HttpRequest("POST", "/pay", b"", json_type, b'{"a":1}')
    >>> b = HttpRequest("POST", "/pay", b"", json_type, b'{ "a": 1 }')
    >>> canonical_request(a) == canonical_request(b)
    True
    """
    return canonical_parts(
        request.method, request.path, request.query, request.headers, request.body, fields, headers
    )


def canonical_parts(
    method: str,
    path: str,
    query: bytes,
    request_headers: Sequence[Header],
    request_body: bytes,
    fields: Collection[FingerprintField] = DEFAULT_FINGERPRINT_FIELDS,
    headers: Collection[str] = (),
) -> bytes:
    """`canonical_request` of a request given in parts, for adapters that would otherwise
    build an `HttpRequest` on every request only to take it apart here."""
    parts: dict[str, Any] = {}
    # Filled in sort_keys order: body, headers, method, path, query, v.
    if "body" in fields:
        content_type = b", ".join(header_values(request_headers, b"content-type"))
        body = _canonical_body(request_body, content_type)
        parts["body"] = hashlib.sha256(body).hexdigest()
    if headers:
        parts["headers"] = {
            name.lower(): [
                value.decode("latin-1")
                for value in header_values(request_headers, name.lower().encode("latin-1"))
            ]
            for name in headers
        }
    if "method" in fields:
        parts["method"] = method.upper()
    if "path" in fields:
        parts["path"] = path
    if "query" in fields:
        parts["query"] = query.decode("latin-1")
    if headers:
        parts["v"] = 1
        return json.dumps(parts, sort_keys=True, separators=(",", ":")).encode()
    # Only strings and the version: the document json.dumps would write (keys in sorted
    # order, each string escaped by the same function), without building an encoder.
    members = [f'"{name}":{_ascii_string(value)}' for name, value in parts.items()]
    members.append('"v":1')
    return ("{" + ",".join(members) + "}").encode()


def request_fingerprint(
    request: HttpRequest,
    *,
    fields: Collection[FingerprintField] = DEFAULT_FINGERPRINT_FIELDS,
    headers: Collection[str] = (),
) -> str:
    """Hex SHA-256 of `canonical_request`: the fingerprint a record keeps for this request."""
    return hashlib.sha256(canonical_request(request, fields=fields, headers=headers)).hexdigest()


# --- stored responses ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HttpResponse:
    """A whole response: status, headers as sent, body bytes."""

    status: int
    headers: tuple[Header, ...] = ()
    body: bytes = b""

    def shareable(self) -> HttpResponse:
        """This response without hop-by-hop fields and ``Set-Cookie``: what may be stored and
        replayed to a later request."""
        kept = _kept(self.headers, _NOT_SHAREABLE)
        if len(kept) == len(self.headers):
            return self  # immutable: nothing to drop, nothing to copy
        return HttpResponse(self.status, kept, self.body)

    def replay(self, *, status_200: bool = False) -> HttpResponse:
        """The answer to a duplicate: this response, shareable, plus ``Idempotent-Replayed``.

        Args:
            status_200: answer 200 instead of a stored 2xx status (the body stays the same).
        """
        headers = _kept(self.headers, _NOT_REPLAYED)
        status = 200 if status_200 and 200 <= self.status < 300 else self.status
        return HttpResponse(status, (*headers, (REPLAYED_HEADER, b"true")), self.body)


def _kept(headers: tuple[Header, ...], dropped: frozenset[bytes]) -> tuple[Header, ...]:
    """``headers`` without the fields named in ``dropped`` or in a ``Connection`` field."""
    names = [name.lower() for name, _ in headers]
    if b"connection" in names:
        dropped = dropped | {
            token.strip().lower()
            for name, (_, value) in zip(names, headers, strict=True)
            if name == b"connection"
            for token in value.split(b",")
        }
    elif dropped.isdisjoint(names):
        return headers  # the usual case: nothing to drop
    return tuple(item for name, item in zip(names, headers, strict=True) if name not in dropped)


@dataclass(frozen=True, slots=True)
class UnkeptResponse:
    """A response that was sent to the client but was too large to store."""

    status: int
    size: int
    limit: int


def encode_response(response: HttpResponse) -> bytes:
    """The stored form: one line of JSON (format version, status, headers), then the body.

    Header bytes travel as Latin-1 text, which maps every byte to one character and back,
    so a replay is byte-identical; the body follows the newline untouched.
    """
    # Written out rather than through json.dumps (which builds an encoder per call): the
    # same bytes, as the format's test checks. ASCII escapes keep the line free of raw
    # newlines whatever the headers hold.
    headers = ",".join(
        [
            f"[{_ascii_string(name.decode('latin-1'))},{_ascii_string(value.decode('latin-1'))}]"
            for name, value in response.headers
        ]
    )
    head = f'{{"v":{_STORED_FORMAT_VERSION},"status":{int(response.status)},"headers":[{headers}]}}'
    return head.encode() + b"\n" + response.body


def decode_response(data: bytes) -> HttpResponse:
    """The response `encode_response` stored.

    Raises:
        CorruptRecordError: ``data`` is not a stored response of this format.
    """
    head_line, newline, body = data.partition(b"\n")
    try:
        head = _json_loads(head_line)
        if not newline or head.get("v") != _STORED_FORMAT_VERSION:
            raise ValueError(f"stored response format {head.get('v')!r}")
        headers = tuple(
            [(name.encode("latin-1"), value.encode("latin-1")) for name, value in head["headers"]]
        )
        status = int(head["status"])
        if not 100 <= status <= 999:  # what an HTTP status line can carry
            raise ValueError(f"status {status}")
        return HttpResponse(status, headers, body)
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise CorruptRecordError(f"the stored response cannot be read: {exc}") from exc


def evict_hint(scope: Scope) -> str:
    """The command that evicts ``scope``'s record, for messages about a corrupt one.

    >>> evict_hint(Scope("", "POST /pay", "k1"))
    "idempo evict STORE-URL k1 --operation 'POST /pay' --principal ''"
    """
    options = (
        f"--operation {shlex.quote(scope.operation)} --principal {shlex.quote(scope.principal)}"
    )
    if scope.key.startswith("-"):  # would read as an option: after "--" it cannot
        return f"idempo evict STORE-URL {options} -- {shlex.quote(scope.key)}"
    return f"idempo evict STORE-URL {shlex.quote(scope.key)} {options}"


Classifier = Callable[[int], Status | None]
"""Decides what a response status means: COMPLETED or FAILED (stored and replayed), or None
(transient: the key is released and a retry executes again)."""

_TRANSIENT_4XX = frozenset({408, 409, 425, 429})


def classify_status(status: int) -> Status | None:
    """SPEC §2 rule 7: 2xx/3xx completed; 4xx failed (replayed) except 408, 409, 425 and
    429; 5xx (and anything else) transient.

    >>> classify_status(201), classify_status(404), classify_status(429), classify_status(503)
    (<Status.COMPLETED: 'completed'>, <Status.FAILED: 'failed'>, None, None)
    """
    if 200 <= status < 400:
        return Status.COMPLETED
    if 400 <= status < 500 and status not in _TRANSIENT_4XX:
        return Status.FAILED
    return None


@dataclass(frozen=True, slots=True)
class HttpCodec:
    """How the guard stores an HTTP response and replays it (the `Codec` for HTTP).

    The block's result is an `HttpResponse` (stored per ``classify``), an `UnkeptResponse`
    (recorded as a FAILED 500 problem if its status would have been stored, so a retry does
    not execute again), or None (the app sent no whole response: the key is released).
    Exceptions release the key.
    """

    classify: Classifier = field(default=classify_status)

    def encode_result(self, value: Any) -> tuple[Status | None, bytes]:
        if isinstance(value, HttpResponse):
            status = self.classify(value.status)
            return status, (encode_response(value.shareable()) if status is not None else b"")
        if isinstance(value, UnkeptResponse) and self.classify(value.status) is not None:
            detail = (
                f"The request was processed and answered {value.status}, but its response "
                f"({value.size} bytes or more) was over the {value.limit}-byte limit for "
                "storage, so it cannot be replayed. Do not retry this key."
            )
            return Status.FAILED, encode_response(_not_stored(detail))
        return None, b""

    def encode_error(self, exc: BaseException) -> tuple[Status | None, bytes]:
        return None, b""

    def encode_unstorable(self, exc: Exception) -> bytes:
        detail = (
            f"The request was processed, but its response could not be stored ({exc}), "
            "so it cannot be replayed. Do not retry this key."
        )
        return encode_response(_not_stored(detail))

    def decode(self, record: Record) -> HttpResponse:
        try:
            if record.response is None:
                raise CorruptRecordError("the record holds no response to replay")
            return decode_response(record.response)
        except CorruptRecordError as exc:
            # Nothing runs and nothing is replayed until an operator evicts the record.
            raise CorruptRecordError(f"{exc}; evict it: {evict_hint(record.scope)}") from exc


def _not_stored(detail: str) -> HttpResponse:
    return problem(500, "response-not-stored", "Response not stored", detail)


# --- problems (RFC 9457) ------------------------------------------------------------------


def problem(
    status: int,
    kind: str,
    title: str,
    detail: str,
    *,
    headers: Sequence[Header] = (),
) -> HttpResponse:
    """An ``application/problem+json`` response whose ``type`` is ``urn:idempo:problem:kind``.

    >>> problem(400, "missing-key", "Missing idempotency key", "Send one.").body[:38]
    b'{"type":"urn:idempo:problem:missing-ke'
    """
    body = json.dumps(
        {"type": PROBLEM_TYPE_BASE + kind, "title": title, "status": status, "detail": detail},
        separators=(",", ":"),
    ).encode()
    return HttpResponse(
        status,
        (
            (b"content-type", b"application/problem+json"),
            (b"content-length", str(len(body)).encode()),
            *headers,
        ),
        body,
    )


def _retry_after(seconds: float) -> Header:
    # Retry-After is a whole number of seconds (RFC 9110 §10.2.3); 0 would invite a storm.
    return (b"retry-after", str(max(1, math.ceil(seconds))).encode())


def problem_for(
    exc: IdempotencyError, *, max_retry_after: int = 5, store_retry_after: int = 5
) -> HttpResponse:
    """The problem response for one of idempo's refusals.

    Args:
        exc: what the guard (or the adapter) raised before any work ran.
        max_retry_after: the most a 409's ``Retry-After`` says, though the lease may end
            later: the first request is usually done long before its lease ends, and asking
            again costs one index lookup.
        store_retry_after: ``Retry-After`` for a 503 when the store is unreachable.
    """
    match exc:
        case MissingKeyError():
            return problem(
                400,
                "missing-key",
                "Missing idempotency key",
                "This endpoint requires an Idempotency-Key header: one unique value per "
                "intent, reused on every retry.",
            )
        case InvalidKeyError():
            return problem(400, "invalid-key", "Malformed idempotency key", str(exc))
        case InvalidPayloadError():
            return problem(400, "invalid-request", "Request cannot be fingerprinted", str(exc))
        case RequestTooLargeError():
            return problem(413, "request-too-large", "Request body too large", str(exc))
        case FingerprintMismatchError():
            return problem(
                422,
                "fingerprint-mismatch",
                "Idempotency key reused with a different request",
                "This Idempotency-Key was already used with a different request (method, "
                "path, query or body). Use a new key for a new intent.",
            )
        case RequestInProgressError(retry_after=retry_after):
            return problem(
                409,
                "request-in-progress",
                "Request in progress",
                "A request with this Idempotency-Key is still being processed. Retry later "
                "to receive its response.",
                headers=[_retry_after(min(retry_after, max_retry_after))],
            )
        case PrincipalRequiredError():
            return problem(
                401,
                "principal-required",
                "Caller not identified",
                "This endpoint could not tell who sent the request, so it cannot keep its "
                "Idempotency-Key apart from other callers' keys. Authenticate, then retry.",
            )
        case FencedError():
            return problem(
                409,
                "lease-lost",
                "Request taken over",
                "This request ran past its lease and another attempt with the same "
                "Idempotency-Key took over; its answer was not stored. Retry with the same "
                "key to receive the answer of the attempt that holds it.",
                headers=[_retry_after(max_retry_after)],
            )
        case CorruptRecordError():
            return problem(
                503,
                "corrupt-record",
                "Stored idempotency record unreadable",
                "The request was not processed: the record stored for this Idempotency-Key "
                "cannot be decoded, and every retry gets this answer until an operator "
                "evicts it (idempo evict; the server's log names the record).",
                headers=[_retry_after(store_retry_after)],
            )
        case SchemaMissingError():
            return problem(
                503,
                "schema-missing",
                "Idempotency store not set up",
                "The request was not processed: the idempotency store has no records table "
                "yet. An operator must run `idempo migrate` (the server's log names the "
                "store); retry with the same key afterwards.",
                headers=[_retry_after(store_retry_after)],
            )
        case StoreError():
            return problem(
                503,
                "store-unavailable",
                "Idempotency store unavailable",
                "The request was not processed: the idempotency store cannot be reached. "
                "Retry with the same key later.",
                headers=[_retry_after(store_retry_after)],
            )
    return problem(500, "internal", "Idempotency error", str(exc))
