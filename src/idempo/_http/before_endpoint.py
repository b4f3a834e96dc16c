"""Answers given before the endpoint ran (SPEC §2 rule 7): the framework's request
validation, a Litestar guard, and so on. The middleware cannot see who answered, so the
framework tells it, through the request's attempt, which the middleware also puts in the
ASGI scope under `BEFORE_ENDPOINT_SCOPE_KEY`: `answered_before_endpoint` calls its
``do_not_store()`` (`idempo.guard.Attempt.do_not_store`, what an endpoint itself calls), and
the key is released instead of the answer stored, so the client may fix its request and
retry with the same key.

idempo calls it for the frameworks it knows, found by duck typing (no framework imported):

* FastAPI: the handler of ``RequestValidationError`` (the 422) in the app's exception
  middleware is wrapped (`watch_starlette`); FastAPI raises it after solving the
  dependencies and before calling the endpoint. So is the ``HTTPException`` handler, which
  marks an exception whose traceback never entered the endpoint's function (a dependency's
  refusal: an auth 401, a 403, a 404 for a missing parent).
* Litestar: an ``after_exception`` hook on the app (`watch_litestar`) marks every exception
  whose traceback never entered the route handler's function (a validation error, a guard's
  refusal, a dependency's): raised in the endpoint, its answer is the endpoint's own, stored.

An app's own check that answers before its endpoint (its own validation or auth middleware
inside the guarded app) may call `answered_before_endpoint` too.

    >>> from idempo import Scope
    >>> from idempo.guard import Attempt
    >>> scope = {"idempo.before_endpoint": Attempt(Scope.of("k", operation="x"), replayed=False)}
    >>> answered_before_endpoint(scope)
    >>> scope["idempo.before_endpoint"].keeps_answer
    False
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator, MutableMapping
from types import CodeType, TracebackType
from typing import Any

__all__ = [
    "BEFORE_ENDPOINT_SCOPE_KEY",
    "answered_before_endpoint",
    "watch_litestar",
    "watch_starlette",
]

BEFORE_ENDPOINT_SCOPE_KEY = "idempo.before_endpoint"
"""Where a guarded request's attempt is, in the scope the app gets, for
`answered_before_endpoint` (an object with a ``do_not_store()`` method)."""

# How far down an app's wrappers (middlewares' ``.app``) the exception middleware is looked
# for: a stack is a handful deep.
_DEPTH = 32


def answered_before_endpoint(scope: MutableMapping[str, Any]) -> None:
    """Say that the answer to this request is given before its endpoint ran: the guarding
    middleware releases the key instead of storing the answer. A no-op on a request that is
    not guarded."""
    attempt = scope.get(BEFORE_ENDPOINT_SCOPE_KEY)
    if attempt is not None:
        attempt.do_not_store()


# --- Starlette / FastAPI -----------------------------------------------------------------


def watch_starlette(app: Any) -> bool:
    """Wrap the ``RequestValidationError`` handler of the exception middleware under ``app``
    (the middleware's inner app: Starlette builds the exception middleware first), or of
    ``app``'s own ``exception_handlers`` when ``app`` is a FastAPI app whose stack is not
    built yet (the middleware wraps the app from outside). True if a handler is watched."""
    watched = False
    for handlers in _exception_handlers(app):
        for cls, handler in list(handlers.items()):
            if _is_request_validation_error(cls):
                watched = True
                if not getattr(handler, "_idempo", False):
                    handlers[cls] = _marking(handler)
            elif _is_http_exception(cls) and not getattr(handler, "_idempo", False):
                handlers[cls] = _marking(handler, _outside_endpoint)
    return watched


def _exception_handlers(app: Any) -> Iterator[dict[Any, Any]]:
    node = app
    for _ in range(_DEPTH):
        if node is None:
            return
        found = getattr(node, "_exception_handlers", None)  # Starlette's ExceptionMiddleware
        if isinstance(found, dict):
            yield found
            return
        if hasattr(node, "middleware_stack"):  # a Starlette app
            stack = node.middleware_stack
            if stack is None:  # built at its first request, from these:
                own = getattr(node, "exception_handlers", None)
                if isinstance(own, dict):
                    yield own
                return
            node = stack
            continue
        node = getattr(node, "app", None)


def _is_request_validation_error(cls: Any) -> bool:
    return isinstance(cls, type) and any(
        base.__name__ == "RequestValidationError" and base.__module__.startswith("fastapi")
        for base in cls.__mro__
    )


def _is_http_exception(cls: Any) -> bool:
    return isinstance(cls, type) and any(
        base.__name__ == "HTTPException" and base.__module__.startswith("starlette")
        for base in cls.__mro__
    )


def _outside_endpoint(scope: MutableMapping[str, Any], exc: BaseException) -> bool:
    """Whether ``exc`` was raised without entering the endpoint the router chose (by a
    dependency). An endpoint that cannot be found keeps the answer stored."""
    codes = _codes(scope.get("endpoint"))
    return bool(codes) and not _entered(exc.__traceback__, codes)


def _marking(
    handler: Callable[..., Any],
    when: Callable[[MutableMapping[str, Any], BaseException], bool] | None = None,
) -> Callable[..., Any]:
    """``handler``, marking the request answered before its endpoint (if ``when`` says so);
    sync stays sync (Starlette runs a sync handler in a thread)."""
    if inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(
        getattr(handler, "__call__", None)  # noqa: B004 - an async callable object
    ):

        @functools.wraps(handler)
        async def marked_async(request: Any, exc: Exception) -> Any:
            if when is None or when(request.scope, exc):
                answered_before_endpoint(request.scope)
            return await handler(request, exc)

        marked_async._idempo = True  # type: ignore[attr-defined]
        return marked_async

    @functools.wraps(handler)
    def marked(request: Any, exc: Exception) -> Any:
        if when is None or when(request.scope, exc):
            answered_before_endpoint(request.scope)
        return handler(request, exc)

    marked._idempo = True  # type: ignore[attr-defined]
    return marked


# --- Litestar ----------------------------------------------------------------------------


def watch_litestar(app: Any) -> None:
    """Add the ``after_exception`` hook to a Litestar app (once)."""
    hooks = getattr(app, "after_exception", None)
    if isinstance(hooks, list) and _litestar_after_exception not in hooks:
        hooks.append(_litestar_after_exception)


async def _litestar_after_exception(exc: BaseException, scope: Any) -> None:
    if scope.get(BEFORE_ENDPOINT_SCOPE_KEY) is None:
        return
    handler = scope.get("route_handler")
    codes = _codes(getattr(handler, "_fn", None))
    # A handler whose function cannot be found keeps today's answer: stored.
    if codes and not _entered(exc.__traceback__, codes):
        answered_before_endpoint(scope)


def _codes(fn: Any) -> frozenset[CodeType]:
    """The code objects of a route handler's function and what it wraps (Litestar's
    AsyncCallable keeps a sync function as ``func``; decorators as ``__wrapped__``)."""
    codes: set[CodeType] = set()
    for _ in range(_DEPTH):
        if fn is None:
            break
        code = getattr(fn, "__code__", None)
        if isinstance(code, CodeType):
            codes.add(code)
        fn = getattr(fn, "__wrapped__", None) or getattr(fn, "func", None)
    return frozenset(codes)


def _entered(tb: TracebackType | None, codes: frozenset[CodeType]) -> bool:
    while tb is not None:
        if tb.tb_frame.f_code in codes:
            return True
        tb = tb.tb_next
    return False
