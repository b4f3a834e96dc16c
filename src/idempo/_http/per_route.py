"""Which requests a middleware guards, and where their key comes from: per route, in each
framework's idiom, and by path rules on the middleware.

A view says what it wants with a decorator that only marks it (Django's ``csrf_exempt`` is
the model), so the order of decorators never matters and the view itself is unchanged:

    >>> @idempotent(require_key=False)
    ... def create_payment(request): ...
    >>> rule_of(create_payment)
    RouteRule(guarded=True, require_key=False, key_from=None)
    >>> @not_idempotent
    ... def login(request): ...
    >>> rule_of(login).guarded
    False

Each adapter finds the endpoint its router picked for a request (a Starlette or FastAPI
route's ``endpoint``, a Litestar handler's ``opt`` or function, Flask's view function,
Django's resolved view, aiohttp's handler) and asks `rule_of`; `Routed` carries the rule
with the route template out of the route-template hook (`idempo._http.routes`).

A key hook (``key_from=``, on the middleware or on one route) takes the request as the lifecycle
reads it (`idempo._http.lifecycle.Request`: ``raw``, ``method``, ``path``, ``query``,
``headers``, ``body``) and answers its key, or None when it has none. `json_field` and
`header_key` are the two hooks webhook receivers need.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any, TypeVar

from .._core.jsondecode import loads as json_loads
from .keys import header_values, parse_key

__all__ = [
    "KeyHook",
    "PathRules",
    "RouteRule",
    "Routed",
    "header_key",
    "idempotent",
    "json_field",
    "not_idempotent",
    "rule_of",
]

KeyHook = Callable[[Any], "str | None"]
"""``request -> key | None``: where a request's key comes from when not from its header."""

ViewT = TypeVar("ViewT")

_MARK = "__idempo_route__"


@dataclass(frozen=True, slots=True)
class RouteRule:
    """What one route asks of the middleware.

    Attributes:
        guarded: False for a route the middleware passes through untouched (a login, a
            health check, a webhook that is idempotent already).
        require_key: whether a request without a key gets 400 (True) or runs unguarded
            (False); None keeps the middleware's ``require_key``.
        key_from: where this route's key comes from (see `KeyHook`); None keeps the
            middleware's (its ``key_from`` hook, else its ``key_header``).
    """

    guarded: bool = True
    require_key: bool | None = None
    key_from: KeyHook | None = None


NOT_GUARDED = RouteRule(guarded=False)


def idempotent(
    view: ViewT | None = None,
    *,
    require_key: bool | None = None,
    key_from: KeyHook | None = None,
) -> Any:
    """Mark a view as guarded, with its own ``require_key`` or key hook.

    Works as ``@idempotent`` and as ``@idempotent(require_key=False)``, above or below the
    framework's route decorator; the view is returned as it was, only marked. A FastAPI
    route may say the same with a dependency (`idempo.contrib.fastapi.Idempotent`), which
    also documents the header in the OpenAPI schema.

    >>> @idempotent(key_from=json_field("id"))
    ... def stripe_webhook(request): ...
    >>> rule_of(stripe_webhook).require_key
    """
    rule = RouteRule(require_key=require_key, key_from=key_from)
    if view is not None:
        return mark(view, rule)
    return lambda view: mark(view, rule)


def not_idempotent(view: ViewT) -> ViewT:
    """Mark a view the middleware passes through untouched, whatever its method.

    >>> @not_idempotent
    ... def login(request): ...
    >>> rule_of(login)
    RouteRule(guarded=False, require_key=None, key_from=None)
    """
    return mark(view, NOT_GUARDED)


def mark(view: ViewT, rule: RouteRule) -> ViewT:
    """Put ``rule`` on ``view`` (a function or any object that takes attributes)."""
    try:
        setattr(view, _MARK, rule)
    except (AttributeError, TypeError) as exc:
        raise TypeError(
            f"cannot mark {view!r} as a view: it takes no attributes; mark the function"
        ) from exc
    return view


def rule_of(endpoint: object) -> RouteRule | None:
    """The rule a view was marked with, None for an unmarked one (the middleware's rules).

    Looks through what frameworks wrap views in: a bound method's function, a class-based
    view's ``view_class`` (Django), ``__wrapped__`` (functools.wraps).
    """
    for _ in range(8):  # wrappers of wrappers, but never a cycle
        rule = getattr(endpoint, _MARK, None)
        if isinstance(rule, RouteRule):
            return rule
        inner = getattr(endpoint, "__func__", None) or getattr(endpoint, "view_class", None)
        inner = inner or getattr(endpoint, "__wrapped__", None)
        if inner is None:
            return None
        endpoint = inner
    return None


@dataclass(frozen=True, slots=True)
class Routed:
    """What a route-template hook answers when it knows the route's rule too."""

    template: str | None
    rule: RouteRule


class PathRules:
    """The middleware's ``include`` and ``exclude`` options: shell-style patterns matched
    against the whole request path (``*`` crosses ``/``, so ``/webhooks/*`` is everything
    below it). A path is guarded when it matches an ``include`` pattern (every path, without
    one) and no ``exclude`` pattern.

    >>> rules = PathRules(include=["/api/*"], exclude=["/api/login", "/api/webhooks/*"])
    >>> [rules.guards(p) for p in ("/api/payments", "/api/login", "/api/webhooks/gh", "/")]
    [True, False, False, False]
    """

    def __init__(self, include: Collection[str] = (), exclude: Collection[str] = ()) -> None:
        for pattern in (*include, *exclude):
            if not isinstance(pattern, str) or not pattern.startswith(("/", "*")):
                raise ValueError(f"a path pattern starts with / (or *), not {pattern!r}")
        self.include = tuple(include)
        self.exclude = tuple(exclude)
        self.everything = not self.include and not self.exclude

    def guards(self, path: str) -> bool:
        """Whether requests to ``path`` are guarded."""
        if self.include and not any(fnmatchcase(path, p) for p in self.include):
            return False
        return not any(fnmatchcase(path, p) for p in self.exclude)


def json_field(*path: str) -> KeyHook:
    """A key hook: the string (or integer) at ``path`` in the request's JSON body, such as
    Stripe's ``event.id``; None when the body is not JSON or has no such field.

    >>> from types import SimpleNamespace
    >>> hook = json_field("data", "id")
    >>> hook(SimpleNamespace(body=b'{"data": {"id": "evt_1"}}')), hook(SimpleNamespace(body=b"x"))
    ('evt_1', None)
    """
    if not path or not all(isinstance(name, str) and name for name in path):
        raise ValueError("json_field takes the names of the fields leading to the key")

    def key(request: Any) -> str | None:
        try:
            found: Any = json_loads(request.body)
        except (ValueError, RecursionError):  # nesting deeper than the parser goes, too
            return None
        for name in path:
            if not isinstance(found, dict):
                return None
            found = found.get(name)
        if isinstance(found, bool) or not isinstance(found, str | int):
            return None
        return str(found)

    key.__qualname__ = f"json_field{path!r}"
    return key


def header_key(name: str) -> KeyHook:
    """A key hook: the value of header ``name`` (a bare token or an sf-string), for one
    route whose sender names its deliveries (``X-GitHub-Delivery``); the middleware-wide
    way is its ``key_header`` option.

    >>> from types import SimpleNamespace
    >>> header_key("X-GitHub-Delivery")(SimpleNamespace(headers=[(b"x-github-delivery", b"d1")]))
    'd1'
    """
    wanted = name.lower().encode("ascii")

    def key(request: Any) -> str | None:
        return parse_key(header_values(request.headers, wanted))

    key.__qualname__ = f"header_key({name!r})"
    return key
