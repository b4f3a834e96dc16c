"""FastAPI: the idempotency contract in the OpenAPI schema, and the per-route dependency.

`idempo.asgi.IdempotencyMiddleware` documents itself in a FastAPI app's OpenAPI schema
(``/openapi.json``, so Swagger UI and generated clients see it): on its first HTTP request
it finds the app (``scope["app"]``) and wraps ``app.openapi`` once. Every operation it guards
then shows

* the ``Idempotency-Key`` header (or the ``key_header`` option's), with `KEY_PATTERN`;
  required where a request without it is refused, absent where a ``key_from`` hook finds
  the key;
* the ``Idempotent-Replayed`` header on the app's own answers (a replay carries it);
* idempo's ``application/problem+json`` answers (the ``IdempotencyProblem`` schema): 400,
  409 (or 202), 413, 422 (beside FastAPI's validation error), 503, and 401 where a
  ``principal=`` resolver may refuse; each status with the problem types it may carry
  (docs/problems.md lists them all).

The schema is documented as the middleware decides at run time: same methods, ``include``
and ``exclude`` paths, routes marked `idempo.http.not_idempotent` left out. A schema exported
without serving the app (a build step that calls ``app.openapi()``) needs
`document_idempotency` first.

`Idempotent` is the per-route idiom: ``dependencies=[Depends(Idempotent(require_key=False))]``
tells the middleware what `idempo.http.idempotent` would, and declares the header itself.

    >>> from fastapi import FastAPI
    >>> from fastapi.testclient import TestClient
    >>> from idempo.asgi import IdempotencyMiddleware
    >>> from idempo.stores.memory import AsyncMemoryStore
    >>> app = FastAPI()
    >>> app.add_middleware(IdempotencyMiddleware, store=AsyncMemoryStore())
    >>> @app.post("/payments")
    ... async def pay() -> dict[str, str]:
    ...     return {"id": "pay_1"}
    >>> with TestClient(app) as client:
    ...     operation = client.get("/openapi.json").json()["paths"]["/payments"]["post"]
    >>> [(p["name"], p["required"]) for p in operation["parameters"]]
    [('Idempotency-Key', True)]
    >>> sorted(operation["responses"])
    ['200', '400', '409', '413', '422', '503']
"""

from __future__ import annotations

import copy
import inspect
import json
import logging
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

from .._optional import optional_import

with optional_import("idempo.contrib.fastapi needs FastAPI", extra="fastapi"):
    from fastapi import Header

from .._http.lifecycle import Admission, Lifecycle
from .._http.options import _OWN_GUARD, HttpSettings, _header_name
from .._http.per_route import KeyHook, Routed, RouteRule, mark
from .._http.response import HttpResponse
from .._http.routes import StarletteRoutes
from .._wire import KEY_HEADER, PROBLEM_MEDIA_TYPE, PROBLEM_TYPE_BASE, REPLAYED_HEADER
from ..errors import (
    ConfigurationError,
    CorruptRecordError,
    FencedError,
    FingerprintMismatchError,
    IdempotencyError,
    InvalidKeyError,
    MissingKeyError,
    PrincipalRequiredError,
    RequestInProgressError,
    RequestTooLargeError,
    SchemaMissingError,
    StoreUnavailableError,
)

if TYPE_CHECKING:
    from ..asgi import IdempotencyMiddleware

__all__ = [
    "KEY_PATTERN",
    "PROBLEM_SCHEMA",
    "REPLAYED_HEADER",
    "Idempotent",
    "document_idempotency",
]

logger = logging.getLogger("idempo.http")

KEY_PATTERN = r'^(?:[!#-~][!-~]{0,254}|"(?:[!#-\[\]-~]|\\["\\]){1,255}")$'
"""An ``Idempotency-Key`` value (SPEC §4): 1-255 printable ASCII characters (0x21-0x7E),
bare, or the same as an RFC 8941 sf-string (``"..."``, with ``\\"`` and ``\\\\`` escapes);
a bare key never starts with ``"``. Documentation only: the middleware checks keys itself."""

PROBLEM_SCHEMA = "IdempotencyProblem"
"""The name of the problem document's schema in ``components.schemas``."""

_PROBLEM_REF = {"$ref": f"#/components/schemas/{PROBLEM_SCHEMA}"}
_PROBLEM_JSON_SCHEMA: dict[str, Any] = {
    "title": PROBLEM_SCHEMA,
    "description": "An RFC 9457 problem: idempo refused the request, or could not keep its "
    "answer. Nothing ran unless the type says so (docs/problems.md lists every type).",
    "type": "object",
    "required": ["type", "title", "status", "detail"],
    "properties": {
        "type": {
            "type": "string",
            "pattern": f"^{PROBLEM_TYPE_BASE}[a-z0-9-]+$",
            "description": "what happened, as a stable URN: urn:idempo:problem:<kind>",
        },
        "title": {"type": "string", "description": "the type, for people"},
        "status": {"type": "integer", "description": "the HTTP status"},
        "detail": {"type": "string", "description": "this occurrence, and what to do"},
    },
}
_KEY_DESCRIPTION = (
    "One value per intent (a UUID is a good one), sent again unchanged on every retry, so "
    "the request runs once and every retry gets its answer: 1-255 printable ASCII characters "
    '(0x21-0x7E), bare or as an RFC 8941 string ("...").'
)
_REPLAYED = {
    "description": "true when this is the stored answer of an earlier request with the same "
    "idempotency key (a replay), byte for byte; absent on a first answer",
    "schema": {"type": "string", "enum": ["true"]},
}
_RETRY_AFTER = {
    "description": "seconds to wait before sending the request again, with the same key",
    "schema": {"type": "integer", "minimum": 1},
}
_PATH_PARAMETER = re.compile(r"\{[^{}]*\}")
_CONVERTER = re.compile(r"\{([^{}:]+):[^{}]*\}")
# What a path parameter is replaced with to ask the router which route a template is:
# digits match Starlette's str, int, float and path converters, the nil UUID its uuid one.
_FILLERS = ("0", "00000000-0000-0000-0000-000000000000")


class Idempotent:
    """A FastAPI dependency that marks its route, as `idempo.http.idempotent` marks a view.

    ``dependencies=[Depends(Idempotent(...))]`` on a route, a router or the app tells
    `idempo.asgi.IdempotencyMiddleware` how to guard the route (the middleware reads the
    route's ``dependencies``; it guards the request before FastAPI runs), and declares the
    key header, so FastAPI puts it in the OpenAPI schema with `KEY_PATTERN`. At run time
    the dependency does nothing: FastAPI never refuses a request over this header (the
    middleware answered 400 already where a key is missing or malformed).

    Args:
        require_key: whether a request without a key gets 400 (True) or runs unguarded
            (False); None keeps the middleware's ``require_key``.
        key_from: where this route's key comes from (`idempo.http.json_field`,
            `idempo.http.header_key`); then no header is declared.
        header: the key header's name: the middleware's ``key_header``.

    The header is declared optional (FastAPI would refuse a request without it otherwise);
    the middleware's own documentation marks it required where it refuses one without it.

    >>> from fastapi import Depends, FastAPI
    >>> from idempo.http import rule_of
    >>> app = FastAPI()
    >>> @app.post("/refunds", dependencies=[Depends(Idempotent(require_key=False))])
    ... async def refund() -> None: ...
    >>> rule_of(app.routes[-1].dependencies[0].dependency)
    RouteRule(guarded=True, require_key=False, key_from=None)
    >>> app.openapi()["paths"]["/refunds"]["post"]["parameters"][0]["name"]
    'Idempotency-Key'
    """

    def __init__(
        self,
        *,
        require_key: bool | None = None,
        key_from: KeyHook | None = None,
        header: str = KEY_HEADER,
    ) -> None:
        _header_name(header)  # a ConfigurationError for what is no header name
        self.require_key = require_key
        self.key_from = key_from
        self.header = header
        mark(self, RouteRule(require_key=require_key, key_from=key_from))
        declared = [] if key_from is not None else [_key_parameter(header)]
        # What FastAPI reads to learn the dependency's parameters (inspect.signature).
        self.__signature__ = inspect.Signature(declared)

    async def __call__(self, **_: Any) -> None:
        """Nothing: the middleware guarded the request before FastAPI ran."""

    def __repr__(self) -> str:
        given = {"require_key": self.require_key, "key_from": self.key_from}
        shown = [f"{name}={value!r}" for name, value in given.items() if value is not None]
        if self.header != KEY_HEADER:
            shown.append(f"header={self.header!r}")
        return f"Idempotent({', '.join(shown)})"


def _key_parameter(header: str) -> inspect.Parameter:
    # `str` with a None default: FastAPI documents a string and never refuses its absence;
    # the pattern is only in the schema (json_schema_extra), never checked by pydantic.
    declared = Header(
        alias=header,
        description=_KEY_DESCRIPTION,
        json_schema_extra={"pattern": KEY_PATTERN},
    )
    return inspect.Parameter(
        "idempotency_key",
        inspect.Parameter.KEYWORD_ONLY,
        default=None,
        annotation=Annotated[str, declared],
    )


def document_idempotency(app: Any, *middlewares: IdempotencyMiddleware) -> None:
    """Document in ``app``'s OpenAPI schema what the middlewares guard (see the module's).

    The middleware does this itself on its first HTTP request; call this for a schema read
    before the app served anything (``app.openapi()`` in a build step that exports it for a
    client generator). Without ``middlewares``, documents the `IdempotencyMiddleware`
    entries of ``app.user_middleware`` (``app.add_middleware``, ``middleware=[...]``) from
    their options, without opening their stores. Documenting the same middleware again
    changes nothing.

    Raises:
        ConfigurationError: no middleware given, and none added to ``app``.

    >>> from fastapi import FastAPI
    >>> from idempo.asgi import IdempotencyMiddleware
    >>> app = FastAPI()
    >>> app.add_middleware(IdempotencyMiddleware, store="memory://", methods=("POST",))
    >>> @app.post("/orders")
    ... async def order() -> None: ...
    >>> document_idempotency(app)
    >>> app.openapi()["paths"]["/orders"]["post"]["parameters"][0]["name"]
    'Idempotency-Key'
    """
    root = str(getattr(app, "root_path", "") or "")
    guards = [_Guard.of(middleware, root) for middleware in middlewares]
    if not middlewares:
        guards = [_Guard.from_options(app, options, root) for options in _added(app)]
        if not guards:
            raise ConfigurationError(
                "document_idempotency found no IdempotencyMiddleware added to the app;"
                " pass the middleware that guards it"
            )
    for guard in guards:
        _install(app, guard)


def document_served(app: Any, middleware: IdempotencyMiddleware, root_path: str) -> None:
    """`document_idempotency`, as the middleware does on its first request: ``root_path``
    is the server's (``scope["root_path"]``), in front of every path it sees."""
    _install(app, _Guard.of(middleware, root_path))


def _added(app: Any) -> Iterator[dict[str, Any]]:
    from ..asgi import IdempotencyMiddleware  # noqa: PLC0415 - idempo.asgi imports this lazily

    for added in getattr(app, "user_middleware", None) or ():
        cls = getattr(added, "cls", None)
        if isinstance(cls, type) and issubclass(cls, IdempotencyMiddleware):
            yield dict(getattr(added, "kwargs", None) or getattr(added, "options", {}))


# The options that build the middleware's guard or its connection: the documentation
# needs none of them, and a stand-in store takes their place.
_NOT_DOCUMENTED = frozenset({"store", "idempotency", *_OWN_GUARD, "connection", "mode"})


@dataclass(frozen=True, slots=True)
class _Guard:
    """What one middleware guards and answers, as its documentation needs it: its
    lifecycle (its settings and route hook), which decides, and answers, as at run time."""

    lifecycle: Lifecycle
    commits_with_app: bool  # ``connection=``: a 503 not-committed is possible
    root_path: str  # in front of every request path the middleware sees

    @property
    def settings(self) -> HttpSettings:
        return self.lifecycle.settings

    @classmethod
    def of(cls, middleware: IdempotencyMiddleware, root_path: str) -> _Guard:
        commits = middleware.settings.connection is not None
        return cls(middleware.lifecycle, commits, root_path)

    @classmethod
    def from_options(cls, app: Any, options: dict[str, Any], root_path: str) -> _Guard:
        from ..stores.memory import AsyncMemoryStore  # noqa: PLC0415 - only for this

        kept = {name: value for name, value in options.items() if name not in _NOT_DOCUMENTED}
        settings = HttpSettings(
            {**kept, "store": AsyncMemoryStore()},
            owner="IdempotencyMiddleware",
            asynchronous=True,
        )
        lifecycle = Lifecycle(settings, settings.routes or StarletteRoutes(app))
        return cls(lifecycle, options.get("connection") is not None, root_path)


def _install(app: Any, guard: _Guard) -> None:
    """Wrap ``app.openapi`` (once per app) so that its schema documents ``guard``'s
    operations; again for the same middleware settings, nothing changes."""
    openapi = getattr(app, "openapi", None)
    if not isinstance(openapi, _DocumentedOpenAPI):
        if not callable(openapi):
            return
        openapi = _DocumentedOpenAPI(app, openapi)
        app.openapi = openapi
    openapi.add(guard)


class _DocumentedOpenAPI:
    """``app.openapi``, whose schema (cached by FastAPI in ``app.openapi_schema``) each
    guard documents once: when FastAPI generates a new one, it is documented anew."""

    def __init__(self, app: Any, original: Callable[[], dict[str, Any]]) -> None:
        self.app = app
        self.original = original
        self.guards: list[_Guard] = []
        self.documented: dict[str, Any] | None = None

    def add(self, guard: _Guard) -> None:
        if any(known.lifecycle is guard.lifecycle for known in self.guards):
            return
        self.guards.append(guard)
        self.documented = None  # a schema made already is documented again, for this one

    def __call__(self) -> dict[str, Any]:
        schema = self.original()
        if schema is not self.documented and isinstance(schema, dict):
            for guard in self.guards:
                try:
                    _document(schema, self.app, guard)
                except Exception:  # the app's schema is served all the same, undocumented
                    logger.exception("idempo could not document the app's OpenAPI schema")
            self.documented = schema
        return schema


@dataclass(frozen=True, slots=True)
class _Needs:
    """What a guarded operation asks of its requests."""

    header: bool  # the key comes from the key header (not from a ``key_from`` hook)
    required: bool


def _document(schema: dict[str, Any], app: Any, guard: _Guard) -> None:
    """Add to ``schema`` (in place) the key header, the replay header and the problem
    answers of every operation ``guard`` guards. Idempotent: what is there stays once."""
    settings = guard.settings
    paths = schema.get("paths")
    if not isinstance(paths, dict):
        return
    found = False
    for template, item in paths.items():
        if not isinstance(item, dict):
            continue
        for method, operation in item.items():
            if method.upper() not in settings.methods or not isinstance(operation, dict):
                continue
            needs = _needs(app, guard, method.upper(), template)
            if needs is not None:
                _document_operation(operation, needs, guard)
                found = True
    if found:
        components = schema.setdefault("components", {})
        schemas = components.setdefault("schemas", {})
        if PROBLEM_SCHEMA not in schemas:
            schemas[PROBLEM_SCHEMA] = copy.deepcopy(_PROBLEM_JSON_SCHEMA)


def _needs(app: Any, guard: _Guard, method: str, template: str) -> _Needs | None:
    """Whether requests to one operation are guarded: `Lifecycle.admit`'s decision, asked
    of a request to it without a key, then with one. None when they pass through (an
    excluded path, a route marked ``not_idempotent``)."""
    settings = guard.settings
    path, routed = _path(app, guard, method, template)
    # A route the hook cannot find for any path (a converter of the app's own): decided by
    # the middleware's options alone, as for a request whose route has no rule.
    lifecycle = guard.lifecycle if routed else Lifecycle(settings)
    scope = _scope(app, method, guard.root_path, path)
    try:
        keyless = lifecycle.admit(scope, method, path, {})
        if isinstance(keyless, Admission):  # a key hook reads the key from the request
            return _Needs(header=False, required=keyless.required)
        if isinstance(keyless, HttpResponse):  # refused without a key
            return _Needs(header=True, required=True)
        keyed = lifecycle.admit(scope, method, path, {settings.key_header: [b"key"]})
    except Exception:  # noqa: BLE001 - the app's own hooks (operation=): its options decide
        if not settings.paths.guards(path):
            return None
        return _Needs(header=settings.key_from is None, required=settings.require_key)
    return None if keyed is None else _Needs(header=True, required=False)


def _path(app: Any, guard: _Guard, method: str, template: str) -> tuple[str, bool]:
    """A request path for ``template`` as the middleware sees it (the root path in front),
    and whether the middleware's route hook finds the route of ``template`` for it."""
    root, routes = guard.root_path, guard.lifecycle.routes
    first = root + _PATH_PARAMETER.sub(_FILLERS[0], template)
    if routes is None:
        return first, False
    for filler in _FILLERS:
        path = root + _PATH_PARAMETER.sub(filler, template)
        try:
            found = routes(_scope(app, method, root, path))
        except Exception:  # noqa: BLE001 - the app's own hook: its options decide
            break
        routed = found.template if isinstance(found, Routed) else found
        # NO_ROUTE or None: the router would not pick this route for the path.
        if isinstance(routed, str) and _CONVERTER.sub(r"{\1}", routed) == template:
            return path, True
    return first, False


def _scope(app: Any, method: str, root: str, path: str) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "server": ("localhost", 80),
        "client": None,
        "root_path": root,
        "path": path,
        "raw_path": path.encode("utf-8"),
        "query_string": b"",
        "headers": [],
        "app": app,
    }


def _document_operation(operation: dict[str, Any], needs: _Needs, guard: _Guard) -> None:
    responses = operation.setdefault("responses", {})
    answers = _answers(guard, needs)
    for status, response in responses.items():
        # The app's own answers are stored and replayed (never a 5xx: those release the
        # key); idempo's own problems, documented before, are not.
        if (
            isinstance(response, dict)
            and "$ref" not in response
            and not status.startswith("5")
            and response.get("description") != _said(answers.get(status, []))
        ):
            headers = response.setdefault("headers", {})
            if REPLAYED_HEADER not in headers:
                headers[REPLAYED_HEADER] = copy.deepcopy(_REPLAYED)
    if needs.header:
        _key_header(operation, guard.settings.key_header_name, needs.required)
    for status, answered in answers.items():
        _problem_response(responses, status, answered)


def _key_header(operation: dict[str, Any], name: str, required: bool) -> None:
    parameters = operation.setdefault("parameters", [])
    for parameter in parameters:
        if (
            isinstance(parameter, dict)
            and parameter.get("in") == "header"
            and str(parameter.get("name", "")).lower() == name.lower()
        ):
            # Declared already (`Idempotent`, or the endpoint's own Header): required where
            # either the middleware or FastAPI refuses a request without it.
            parameter["required"] = bool(parameter.get("required")) or required
            parameter.setdefault("description", _KEY_DESCRIPTION)
            return
    parameters.append(
        {
            "name": name,
            "in": "header",
            "required": required,
            "description": _KEY_DESCRIPTION,
            "schema": {"type": "string", "pattern": KEY_PATTERN},
        }
    )


@dataclass(frozen=True, slots=True)
class _Answer:
    kind: str
    title: str
    body: dict[str, Any]
    retry_after: bool


def _answers(guard: _Guard, needs: _Needs) -> dict[str, list[_Answer]]:
    """The problems the middleware may answer a request of this operation with, by status:
    made by the code that answers them, with the middleware's options."""
    settings, lifecycle = guard.settings, guard.lifecycle
    refusals: list[IdempotencyError] = [
        InvalidKeyError("the idempotency key must be printable ASCII without spaces")
    ]
    if needs.required:
        refusals.append(MissingKeyError(header=settings.key_header_name))
    refusals += [
        RequestTooLargeError(settings.max_request_bytes),
        FingerprintMismatchError("key"),
        RequestInProgressError("key", retry_after=settings.max_retry_after),
        FencedError("the lease was lost"),
    ]
    if settings.principal is not None and not settings.principals.allow_anonymous:
        refusals.append(PrincipalRequiredError("no principal"))
    refusals += [CorruptRecordError("unreadable"), SchemaMissingError("no table")]
    if not settings.fail_open:
        refusals.append(StoreUnavailableError("unreachable"))
    made = [lifecycle.problem(exc) for exc in refusals]
    if guard.commits_with_app:
        made.append(lifecycle.not_committed())
    by_status: dict[str, list[_Answer]] = {}
    for response in sorted(made, key=lambda response: response.status):
        by_status.setdefault(str(response.status), []).append(_answer(response))
    return by_status


def _answer(response: HttpResponse) -> _Answer:
    body = json.loads(response.body)
    kind = str(body["type"]).removeprefix(PROBLEM_TYPE_BASE)
    retry_after = any(name == b"retry-after" for name, _ in response.headers)
    return _Answer(kind, str(body["title"]), body, retry_after)


def _said(answers: list[_Answer]) -> str:
    """What a response says of idempo's answers (all it says, where idempo added it)."""
    return "idempo: " + "; ".join(f"{answer.title} ({answer.kind})" for answer in answers)


def _problem_response(responses: dict[str, Any], status: str, answers: list[_Answer]) -> None:
    said = _said(answers)
    response = responses.get(status)
    if not isinstance(response, dict) or "$ref" in response:
        if response is not None:
            return  # a shared response the app defined: its own
        response = responses[status] = {"description": said}
    elif said not in str(response.get("description", "")):
        described = str(response.get("description", "")).rstrip()
        response["description"] = f"{described}\n\n{said}" if described else said
    content = response.setdefault("content", {})
    media = content.setdefault(PROBLEM_MEDIA_TYPE, {"schema": dict(_PROBLEM_REF)})
    shown = media.get("schema")
    if shown is None:
        media["schema"] = dict(_PROBLEM_REF)
    elif shown != _PROBLEM_REF and not (
        isinstance(shown, dict) and _PROBLEM_REF in shown.get("anyOf", ())
    ):
        # The app answers problems of its own at this status too: either document.
        media["schema"] = {"anyOf": [shown, dict(_PROBLEM_REF)]}
    if "example" not in media:
        examples = media.setdefault("examples", {})
        for answer in answers:
            examples.setdefault(answer.kind, {"summary": answer.title, "value": answer.body})
    headers = response.setdefault("headers", {})
    if any(answer.retry_after for answer in answers) and "Retry-After" not in headers:
        headers["Retry-After"] = copy.deepcopy(_RETRY_AFTER)
    if not headers:
        del response["headers"]
