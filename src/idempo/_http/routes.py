"""Route templates: the ``route-template`` half of an HTTP operation (``POST /payments/{id}``).

Each adapter asks one hook per request, the ``routes=`` option (`HttpOptions`): a callable
``request -> template | None``. Without one, the adapter's default reads its framework's
router: `StarletteRoutes` (Starlette, FastAPI, Litestar) for ASGI, `FlaskRoutes` for WSGI,
Django's resolver and aiohttp's ``match_info`` in their adapters. Every default is found by
duck typing, so idempo imports no framework. None (use the raw path) is always safe: more
operations never replay another endpoint's answer.

    >>> hook = StarletteRoutes(app=None)
    >>> hook({"type": "http", "method": "POST", "path": "/items"}) is None
    True
"""

from __future__ import annotations

import enum
from collections.abc import Callable, MutableMapping
from typing import Any, Final, Literal, TypeVar

from .per_route import Routed, RouteRule, rule_of

__all__ = [
    "NO_ROUTE",
    "FlaskRoutes",
    "NoRoute",
    "RouteTemplate",
    "StarletteRoutes",
    "flask_route_template",
    "route_template",
]

RequestT = TypeVar("RequestT")


class NoRoute(enum.Enum):
    """The type of `NO_ROUTE`."""

    NO_ROUTE = "no route"


NO_ROUTE: Final = NoRoute.NO_ROUTE
"""What a route-template hook answers for a request no route of the app matches, when it
is sure of it (the router will answer 404 or 405 itself): the adapter passes the request
through unguarded and stores nothing (SPEC §2 rule 7, an answer given before the endpoint
ran). A hook that cannot be sure answers None: the request is guarded under its path."""

RouteTemplate = Callable[[Any], "str | Routed | Literal[NoRoute.NO_ROUTE] | None"]
"""The hook: what a request's route template is, None when it has none, `NO_ROUTE` when
no route matches it; `Routed` when the route was marked with a rule (`idempotent`)."""

Template = str | Routed | Literal[NoRoute.NO_ROUTE] | None

Scope = MutableMapping[str, Any]
Environ = dict[str, Any]


class FlaskRoutes:
    """The WSGI default: the Werkzeug rule of a Flask app (`flask_route_template`)."""

    def __init__(self, flask_app: Any) -> None:
        self.flask_app = flask_app

    def __call__(self, environ: Environ) -> Template:
        return _flask_rule(self.flask_app, environ)


def flask_route_template(flask_app: Any, environ: Environ) -> str | None:
    """The Flask (Werkzeug) rule a request matches (``/payments/<int:id>``), or None.

    Duck-typed on ``url_map.bind_to_environ(environ).match(return_rule=True)``, so idempo
    imports no framework. None (use the raw path) is always safe: more operations never
    replay another endpoint's answer.
    """
    found = _flask_rule(flask_app, environ)
    if isinstance(found, Routed):
        return found.template
    return None if found is NO_ROUTE else found


def _flask_rule(flask_app: Any, environ: Environ) -> Template:
    try:
        rule, _ = flask_app.url_map.bind_to_environ(environ).match(return_rule=True)
    except Exception as exc:  # noqa: BLE001 - a redirect, or an app we cannot ask: no template
        # Werkzeug's router answers these itself, before any view runs.
        unrouted = type(exc).__name__ in ("NotFound", "MethodNotAllowed")
        return NO_ROUTE if unrouted else None
    template = getattr(rule, "rule", None)
    template = template if isinstance(template, str) else None
    views = getattr(flask_app, "view_functions", None)
    marked = rule_of(views.get(getattr(rule, "endpoint", None))) if views else None
    return template if marked is None else Routed(template, marked)


def route_template(app: Any, scope: Scope) -> str | None:
    """The route template a request matches (``/payments/{id}``), or None.

    A framework that routes before its middleware runs says so in the scope: Litestar sets
    ``path_template`` (its app-level ``middleware=`` run per route). Otherwise works on
    anything shaped like a Starlette router (Starlette, FastAPI): ``routes`` whose items
    answer ``matches(scope)`` and carry a ``path``; mounts and FastAPI's included routers are
    searched too. Found by duck typing, so idempo imports no framework. None (use the raw
    path) is always safe: more operations never replay another endpoint's answer.
    """
    found = _routed(app, scope)
    return found.template if isinstance(found, Routed) else found


def _routed(app: Any, scope: Scope) -> str | Routed | None:
    """`route_template`, as a `Routed` when the route's endpoint was marked with a rule."""
    routed = scope.get("path_template")
    if isinstance(routed, str) and routed:
        # Litestar: the handler's ``opt`` (``opt={"idempotency": ...}``) or its function.
        handler = scope.get("route_handler")
        rule = _litestar_rule(handler) if handler is not None else None
        return routed if rule is None else Routed(routed, rule)
    routes = _routes(app)
    if not routes:
        return None
    found = _match(routes, dict(scope), "")
    return None if found is None else _with_rule(found)


def _with_rule(found: Found) -> str | Routed | None:
    _, template, rule = found
    return template if rule is None else Routed(template, rule)


def _litestar_rule(handler: Any) -> RouteRule | None:
    opt = getattr(handler, "opt", None)
    given = opt.get("idempotency") if isinstance(opt, dict) else None
    if isinstance(given, RouteRule):
        return given
    if given is not None:
        return rule_of(given)  # a view marked with `idempotent`, or the decorator's result
    return rule_of(getattr(handler, "fn", None))


def _template(app: Any, scope: Scope) -> Template:
    """`route_template`, but `NO_ROUTE` where no route matches in full (the router
    answers 404, or 405 for a path matched under another method). Only for routes
    `_decided_by_path`: for those, idempo matches exactly as the router will."""
    found = _match(_routes(app), dict(scope), "")
    if found is None or found[0] != _FULL:
        return NO_ROUTE
    return _with_rule(found)


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


class StarletteRoutes:
    """The ASGI default hook: `route_template` of the app the scope names
    (``scope["app"]``, set by Starlette and FastAPI) or of the guarded ``app``.

    Remembered per (method, root path, path) for an app whose routes are matched on those
    alone (`_decided_by_path`): matching walks every route before the one that matches, on
    every request.

    A different app, routes list or number of routes starts afresh, so routes added at run
    time are seen (inside a mount they are not: a template there is as the first request to
    the path found it). At most `LIMIT` paths are kept; then the memory starts again.
    """

    LIMIT = 1024

    def __init__(self, app: Any) -> None:
        self.app = app
        # One tuple, replaced whole: concurrent requests never see half of a reset.
        self._state: tuple[Any, Any, int, dict[tuple[str, str, str], Template] | None] = (
            None,
            None,
            0,
            None,
        )

    def __call__(self, scope: Scope) -> Template:
        app = scope.get("app", self.app)
        routes = getattr(app, "routes", None)  # `_routes`, inlined: runs on every request
        if routes is None:
            routes = _routes(app)
        if not routes or "path_template" in scope:
            return _routed(app, scope)
        known_app, known_routes, count, known = self._state
        if app is not known_app or routes is not known_routes or len(routes) != count:
            known = {} if _decided_by_path(routes) else None
            self._state = (app, routes, len(routes), known)
        if known is None:
            return _routed(app, scope)
        where = (scope["method"], scope.get("root_path", ""), scope["path"])
        try:
            return known[where]
        except KeyError:
            pass
        template = _template(app, scope)
        if len(known) >= self.LIMIT:
            known.clear()
        known[where] = template
        return template


# Starlette's Match enum, by name: FULL (path and method), PARTIAL (path only: the app will
# answer 405, under the same template), NONE.
_FULL, _PARTIAL = "FULL", "PARTIAL"

Found = tuple[str, str | None, "RouteRule | None"]
"""How a route matched: FULL or PARTIAL, its template, the rule its endpoint was marked
with."""


def _match(routes: Any, scope: dict[str, Any], prefix: str) -> Found | None:
    """How ``routes`` match (`Found`), None when none does."""
    # Starlette's Router takes the first FULL match, else the first PARTIAL one.
    partial: Found | None = None
    for route in routes:
        found = _try(route, scope, prefix)
        if found is None:
            continue
        if found[0] == _FULL:
            return found
        if partial is None:
            partial = found
    return partial


def _try(route: Any, scope: dict[str, Any], prefix: str) -> Found | None:
    """How one route matches (`Found`), or None."""
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
        return kind, path, _endpoint_rule(route)
    # A Mount: its own routes decide. A mounted app we cannot see into has no template.
    inner = getattr(route, "routes", None)
    if not inner:
        return kind, None, None
    found = _match(inner, {**scope, **dict(child or {})}, path)
    # The mount's own router answers a path none of its routes matches (404).
    if found is None:
        return None
    return (_PARTIAL if kind == _PARTIAL else found[0]), found[1], found[2]


def _endpoint_rule(route: Any) -> RouteRule | None:
    """The rule a Starlette or FastAPI route's endpoint was marked with, or one of its
    FastAPI ``dependencies=`` (`idempo.contrib.fastapi.Idempotent`)."""
    rule = rule_of(getattr(route, "endpoint", None))
    if rule is not None:
        return rule
    for depends in getattr(route, "dependencies", None) or ():
        rule = rule_of(getattr(depends, "dependency", None))
        if rule is not None:
            return rule
    return None


def _try_contexts(contexts: Any, scope: dict[str, Any], prefix: str) -> Found | None:
    partial: Found | None = None
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


def _try_path_regex(route: Any, scope: dict[str, Any], prefix: str) -> Found | None:
    regex = getattr(route, "path_regex", None)
    template = getattr(route, "path_format", None)
    if regex is None or not isinstance(template, str) or not regex.match(_route_path(scope)):
        return None
    methods = getattr(route, "methods", None)
    kind = _FULL if not methods or scope.get("method") in methods else _PARTIAL
    return kind, prefix + template, _endpoint_rule(route)


def _route_path(scope: dict[str, Any]) -> str:
    """The path below the scope's root path, as Starlette's routers see it."""
    path = str(scope.get("path", ""))
    root = str(scope.get("root_path", ""))
    if root and path.startswith(root) and path[len(root) : len(root) + 1] in ("", "/"):
        return path[len(root) :]
    return path
