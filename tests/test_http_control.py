"""Per-route control, path rules, key hooks and SPEC §4's second convention, on every HTTP
adapter: Starlette, FastAPI and Litestar (ASGI), Flask (WSGI), Django and aiohttp.

Every framework serves the same small API, each route marked in its own idiom:

* ``POST /pay``: guarded (the middleware's rules);
* ``POST /login``: `not_idempotent`, so never guarded;
* ``POST /optional``: `idempotent(require_key=False)`: guarded with a key, runs without;
* ``POST /hook``: `idempotent(key_from=json_field("id"))`, a webhook keyed by its body;
* ``POST /open/{name}``: left to the ``exclude`` option.

A request whose JSON body says ``"nest": true`` sends itself again, same key and body, from
inside the endpoint, while the first is still running: the nested answer is the in-progress
one, seen without threads or timing.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import httpx
import pytest
from litestar import Litestar, post
from litestar import Request as LitestarRequest
from litestar.middleware import DefineMiddleware
from litestar.params import FromPath
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse

from helpers import new_key
from idempo.asgi import IdempotencyMiddleware
from idempo.http import RouteRule, idempotent, json_field, not_idempotent
from idempo.stores.memory import AsyncMemoryStore, MemoryStore

PROBLEM = "urn:idempo:problem:"
Nest = Callable[[str, bytes, dict[str, str]], Any]


class Backend:
    """What ran, per route, and how an endpoint sends its own request again."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.lock = threading.Lock()

    def count(self, name: str) -> dict[str, Any]:
        with self.lock:
            self.calls[name] += 1
            return {"route": name, "execution": self.calls[name]}


def answer_of(response: httpx.Response) -> dict[str, Any]:
    """What a nested request got: its status, Retry-After and problem type."""
    body = response.json() if response.content else {}
    return {
        "status": response.status_code,
        "retry_after": response.headers.get("retry-after"),
        "type": body.get("type") if isinstance(body, dict) else None,
    }


def wants_nesting(body: bytes) -> bool:
    try:
        return bool(json.loads(body or b"{}").get("nest"))
    except ValueError:
        return False


def forwarded(headers: Any) -> dict[str, str]:
    return {name: value for name, value in headers.items() if name.lower() == "idempotency-key"}


# --- one app per framework ----------------------------------------------------------------


def starlette_app(backend: Backend, options: dict[str, Any], fastapi: bool = False) -> Any:
    holder: dict[str, Any] = {}

    async def respond(name: str, request: Request) -> JSONResponse:
        body = await request.body()
        content = backend.count(name)
        if wants_nesting(body):
            transport = httpx.ASGITransport(app=holder["app"])
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                nested = await client.post(
                    request.url.path, content=body, headers=forwarded(request.headers)
                )
            content["nested"] = answer_of(nested)
        return JSONResponse(content, status_code=201)

    async def pay(request: Request) -> JSONResponse:
        return await respond("pay", request)

    @not_idempotent
    async def login(request: Request) -> JSONResponse:
        return await respond("login", request)

    @idempotent(require_key=False)
    async def optional(request: Request) -> JSONResponse:
        return await respond("optional", request)

    @idempotent(key_from=json_field("id"))
    async def hook(request: Request) -> JSONResponse:
        return await respond("hook", request)

    async def opened(request: Request) -> JSONResponse:
        return await respond("open", request)

    middleware = [Middleware(IdempotencyMiddleware, store=AsyncMemoryStore(), **options)]
    views = {"/pay": pay, "/login": login, "/optional": optional, "/hook": hook}
    if fastapi:
        from fastapi import FastAPI

        app: Any = FastAPI(middleware=middleware)
        for path, view in views.items():
            app.add_api_route(path, view, methods=["POST"])
        app.add_api_route("/open/{name}", opened, methods=["POST"])
    else:
        from starlette.applications import Starlette
        from starlette.routing import Route

        routes = [Route(path, view, methods=["POST"]) for path, view in views.items()]
        routes.append(Route("/open/{name}", opened, methods=["POST"]))
        app = Starlette(routes=routes, middleware=middleware)
    holder["app"] = app
    return app


def litestar_app(backend: Backend, options: dict[str, Any]) -> Any:
    holder: dict[str, Any] = {}

    async def respond(name: str, request: LitestarRequest[Any, Any, Any]) -> dict[str, Any]:
        body = await request.body()
        content = backend.count(name)
        if wants_nesting(body):
            transport = httpx.ASGITransport(app=holder["app"])
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                nested = await client.post(
                    request.url.path, content=body, headers=forwarded(request.headers)
                )
            content["nested"] = answer_of(nested)
        return content

    @post("/pay")
    async def pay(request: LitestarRequest[Any, Any, Any]) -> dict[str, Any]:
        return await respond("pay", request)

    # Litestar's own idiom: the handler's opt; the decorator works on its function too.
    @post("/login", opt={"idempotency": RouteRule(guarded=False)})
    async def login(request: LitestarRequest[Any, Any, Any]) -> dict[str, Any]:
        return await respond("login", request)

    @post("/optional")
    @idempotent(require_key=False)
    async def optional(request: LitestarRequest[Any, Any, Any]) -> dict[str, Any]:
        return await respond("optional", request)

    @post("/hook", opt={"idempotency": idempotent(key_from=json_field("id"))(lambda: None)})
    async def hook(request: LitestarRequest[Any, Any, Any]) -> dict[str, Any]:
        return await respond("hook", request)

    @post("/open/{name:str}")
    async def opened(
        request: LitestarRequest[Any, Any, Any], name: FromPath[str]
    ) -> dict[str, Any]:
        return await respond("open", request)

    app = Litestar(
        route_handlers=[pay, login, optional, hook, opened],
        middleware=[DefineMiddleware(IdempotencyMiddleware, store=AsyncMemoryStore(), **options)],
    )
    holder["app"] = app
    return app


def flask_app(backend: Backend, options: dict[str, Any]) -> Any:
    from flask import Flask, jsonify, request

    from idempo.wsgi import IdempotencyWSGIMiddleware

    app = Flask(__name__)

    def respond(name: str) -> Any:
        body = request.get_data()
        content = backend.count(name)
        if wants_nesting(body):
            with httpx.Client(transport=httpx.WSGITransport(app=app.wsgi_app)) as client:
                nested = client.post(
                    f"http://t{request.path}", content=body, headers=forwarded(request.headers)
                )
            content["nested"] = answer_of(nested)
        return jsonify(content), 201

    @app.post("/pay")
    def pay() -> Any:
        return respond("pay")

    @app.post("/login")
    @not_idempotent
    def login() -> Any:
        return respond("login")

    @idempotent(require_key=False)  # above the route decorator: the same view, marked
    @app.post("/optional")
    def optional() -> Any:
        return respond("optional")

    @app.post("/hook")
    @idempotent(key_from=json_field("id"))
    def hook() -> Any:
        return respond("hook")

    @app.post("/open/<name>")
    def opened(name: str) -> Any:
        return respond("open")

    app.wsgi_app = IdempotencyWSGIMiddleware(  # type: ignore[method-assign]
        app.wsgi_app, store=MemoryStore(), routes=app, **options
    )
    return app.wsgi_app


# Django's URLs are module-level: the views read the test's backend from here.
_django: dict[str, Any] = {}


def _django_view(name: str) -> Callable[[Any], Any]:
    def view(request: Any) -> Any:
        from django.http import JsonResponse

        backend: Backend = _django["backend"]
        content = backend.count(name)
        if wants_nesting(request.body):
            with httpx.Client(transport=httpx.WSGITransport(app=_django["app"])) as client:
                nested = client.post(
                    f"http://testserver{request.path}",
                    content=request.body,
                    headers=forwarded(request.headers),
                )
            content["nested"] = answer_of(nested)
        return JsonResponse(content, status=201)

    return view


def _django_urls() -> list[Any]:
    from django.urls import path
    from django.views.decorators.csrf import csrf_exempt

    return [
        path("pay", _django_view("pay")),
        path("login", csrf_exempt(not_idempotent(_django_view("login")))),
        path("optional", idempotent(require_key=False)(_django_view("optional"))),
        path("hook", idempotent(key_from=json_field("id"))(_django_view("hook"))),
        path("open/<str:name>", lambda request, name: _django_view("open")(request)),
    ]


urlpatterns: list[Any] = []


@contextmanager
def django_app(backend: Backend, options: dict[str, Any]) -> Iterator[Any]:
    from django.core.handlers.wsgi import WSGIHandler
    from django.test import override_settings

    import django_setup  # noqa: F401 - configures Django once per process

    urlpatterns[:] = _django_urls()
    settings = {name.upper(): value for name, value in options.items()}
    with override_settings(ROOT_URLCONF=__name__, IDEMPO={"STORE": MemoryStore(), **settings}):
        _django.update(backend=backend, app=WSGIHandler())
        yield _django["app"]


@contextmanager
def aiohttp_app(backend: Backend, options: dict[str, Any]) -> Iterator[str]:
    from aiohttp import web

    from idempo.contrib.aiohttp import IdempotencyMiddleware

    base: dict[str, str] = {}

    def handler(name: str) -> Callable[[web.Request], Any]:
        async def respond(request: web.Request) -> web.Response:
            body = await request.read()
            content = backend.count(name)
            if wants_nesting(body):
                async with httpx.AsyncClient(base_url=base["url"]) as client:
                    nested = await client.post(
                        request.path, content=body, headers=forwarded(request.headers)
                    )
                content["nested"] = answer_of(nested)
            return web.json_response(content, status=201)

        return respond

    app = web.Application(middlewares=[IdempotencyMiddleware(store=AsyncMemoryStore(), **options)])
    app.router.add_post("/pay", handler("pay"))
    app.router.add_post("/login", not_idempotent(handler("login")))
    app.router.add_post("/optional", idempotent(require_key=False)(handler("optional")))
    app.router.add_post("/hook", idempotent(key_from=json_field("id"))(handler("hook")))
    app.router.add_post("/open/{name}", handler("open"))

    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    base["url"] = f"http://127.0.0.1:{port}"
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield base["url"]
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


FRAMEWORKS = ["starlette", "fastapi", "litestar", "flask", "django", "aiohttp"]


class Api:
    """One framework's app behind idempo, and a client for it."""

    def __init__(self, client: httpx.Client, backend: Backend) -> None:
        self.client = client
        self.backend = backend

    def post(
        self, path: str, body: dict[str, Any] | bytes, key: str | None = None
    ) -> httpx.Response:
        headers = {} if key is None else {"Idempotency-Key": key}
        content = body if isinstance(body, bytes) else json.dumps(body)
        return self.client.post(path, content=content, headers=headers)

    def runs(self, route: str) -> int:
        return self.backend.calls[route]


@pytest.fixture(params=FRAMEWORKS)
def serve(request: pytest.FixtureRequest) -> Iterator[Callable[..., Api]]:
    """``serve(**options)``: the framework's app with these middleware options."""
    framework = request.param
    stack = ExitStack()

    def start(**options: Any) -> Api:
        backend = Backend()
        if framework in ("starlette", "fastapi", "litestar"):
            from starlette.testclient import TestClient

            if framework == "litestar":
                app = litestar_app(backend, options)
            else:
                app = starlette_app(backend, options, fastapi=framework == "fastapi")
            client: httpx.Client = TestClient(app)
        elif framework == "flask":
            client = httpx.Client(
                transport=httpx.WSGITransport(app=flask_app(backend, options)), base_url="http://t"
            )
        elif framework == "django":
            app = stack.enter_context(django_app(backend, options))
            client = httpx.Client(
                transport=httpx.WSGITransport(app=app), base_url="http://testserver"
            )
        else:
            client = httpx.Client(base_url=stack.enter_context(aiohttp_app(backend, options)))
        stack.callback(client.close)
        return Api(client, backend)

    with stack:
        yield start


def problem_type(response: httpx.Response) -> str:
    assert response.headers["content-type"] == "application/problem+json"
    return str(response.json()["type"]).removeprefix(PROBLEM)


# --- the tests ----------------------------------------------------------------------------


def test_routes_marked_not_idempotent_and_excluded_paths_pass_through(
    serve: Callable[..., Api],
) -> None:
    """Neither needs a key, and both run on every request, keyed or not."""
    api = serve(exclude=["/open/*"])
    key = new_key()
    for _ in range(2):
        assert api.post("/login", {"user": "ada"}).status_code == 201
        assert api.post("/login", {"user": "ada"}, key).status_code == 201
        assert api.post("/open/x", {}).status_code == 201
        assert api.post("/open/x", {}, key).status_code == 201
    assert api.runs("login") == 4
    assert api.runs("open") == 4
    # The middleware's own rules still hold everywhere else.
    assert problem_type(api.post("/pay", {})) == "missing-key"
    assert api.runs("pay") == 0


def test_a_route_may_make_the_key_optional(serve: Callable[..., Api]) -> None:
    """Without a key it runs unguarded; with one it is guarded like any route."""
    api = serve()
    assert api.post("/optional", {}).status_code == 201
    assert api.post("/optional", {}).status_code == 201
    key = new_key()
    first = api.post("/optional", {"n": 1}, key)
    again = api.post("/optional", {"n": 1}, key)
    assert again.content == first.content
    assert again.headers["idempotent-replayed"] == "true"
    assert api.runs("optional") == 3


def test_include_guards_only_the_paths_it_names(serve: Callable[..., Api]) -> None:
    api = serve(include=["/pay"])
    assert problem_type(api.post("/pay", {})) == "missing-key"
    assert api.post("/optional", {}, new_key()).status_code == 201
    key = new_key()
    api.post("/hook", {"id": key})
    api.post("/hook", {"id": key})
    assert api.runs("hook") == 2  # not included: the hook's route is not guarded at all


def test_a_webhook_keyed_by_its_body_runs_once_per_event(serve: Callable[..., Api]) -> None:
    """Stripe's ``event.id`` is the key: the sender's redeliveries replay the first answer."""
    api = serve()
    event = {"id": f"evt_{new_key()}", "type": "payment_intent.succeeded"}
    first = api.post("/hook", event)
    redelivered = api.post("/hook", event)
    assert first.status_code == redelivered.status_code == 201
    assert redelivered.content == first.content
    assert redelivered.headers["idempotent-replayed"] == "true"
    assert api.runs("hook") == 1
    # The same id with another body is the sender's bug, refused.
    assert problem_type(api.post("/hook", {**event, "type": "other"})) == "fingerprint-mismatch"
    # No id: the hook finds no key, and the route requires one.
    assert problem_type(api.post("/hook", {"type": "ping"})) == "missing-key"
    assert problem_type(api.post("/hook", {"id": "has space"})) == "invalid-key"
    # A body no parser can read gives the hook no key: never a 5xx (SPEC §8).
    deep = b'{"id": ' * 100_000 + b'"evt_deep"' + b"}" * 100_000
    assert problem_type(api.post("/hook", deep)) == "missing-key"
    assert api.runs("hook") == 1


def test_the_hook_is_called_with_the_whole_request(serve: Callable[..., Api]) -> None:
    """A middleware-wide ``key_from`` reads headers and body alike; its None means no key."""
    seen: list[tuple[str, str]] = []

    def key_from(request: Any) -> str | None:
        seen.append((request.method, request.path))
        found = json.loads(request.body or b"{}").get("delivery")
        return None if found is None else str(found)

    api = serve(key_from=key_from, require_key=False)
    delivery = new_key()
    api.post("/pay", {"delivery": delivery})
    api.post("/pay", {"delivery": delivery})
    api.post("/pay", {})
    api.post("/pay", {})
    assert api.runs("pay") == 3  # one for the delivery, two unguarded
    assert seen[0] == ("POST", "/pay")


def test_the_201_200_409_convention(serve: Callable[..., Api]) -> None:
    """SPEC §4's payment-API contract: 201 processed now, 200 duplicate with the original
    body, 409 for the same key with another body, 202 + Retry-After while in progress."""
    api = serve(replay_status_200=True, mismatch_status=409, in_progress_status=202)
    key = new_key()
    first = api.post("/pay", {"amount": 10, "nest": True}, key)
    assert first.status_code == 201
    nested = first.json()["nested"]
    assert nested["status"] == 202
    assert int(nested["retry_after"]) >= 1
    assert nested["type"] == PROBLEM + "request-in-progress"
    duplicate = api.post("/pay", {"amount": 10, "nest": True}, key)
    assert duplicate.status_code == 200
    assert duplicate.content == first.content
    assert duplicate.headers["idempotent-replayed"] == "true"
    mismatch = api.post("/pay", {"amount": 11}, key)
    assert mismatch.status_code == 409
    assert problem_type(mismatch) == "fingerprint-mismatch"
    assert "retry-after" not in mismatch.headers
    assert api.runs("pay") == 1


def test_the_default_convention_is_409_in_progress_and_422_mismatch(
    serve: Callable[..., Api],
) -> None:
    api = serve()
    key = new_key()
    first = api.post("/pay", {"nest": True}, key)
    assert first.json()["nested"]["status"] == 409
    assert first.json()["nested"]["type"] == PROBLEM + "request-in-progress"
    assert api.post("/pay", {"other": True}, key).status_code == 422
    assert api.post("/pay", {"nest": True}, key).status_code == 201


# --- the client transport on either convention ---------------------------------------------


@contextmanager
def uvicorn_server(app: Any) -> Iterator[str]:
    """``app`` on a real uvicorn server, on a free loopback port."""
    import socket
    import time

    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, lifespan="off", log_config=None, log_level="critical")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@pytest.mark.parametrize("in_progress_status", [409, 202])
@pytest.mark.parametrize("mismatch_status", [422, 409])
def test_the_client_transport_understands_both_conventions(
    in_progress_status: int, mismatch_status: int
) -> None:
    """A duplicate sent while the first runs waits (409 or 202, Retry-After) and gets the
    first answer; a mismatch (422 or 409) is returned at once, never retried."""
    from starlette.applications import Starlette
    from starlette.routing import Route

    from idempo.client import IdempotentTransport, RetryPolicy

    started, gate = threading.Event(), threading.Event()
    runs: Counter[str] = Counter()

    async def pay(request: Request) -> JSONResponse:
        runs["pay"] += 1
        started.set()
        await asyncio.to_thread(gate.wait, 10)
        return JSONResponse({"paid": runs["pay"]}, status_code=201)

    app = Starlette(
        routes=[Route("/pay", pay, methods=["POST"])],
        middleware=[
            Middleware(
                IdempotencyMiddleware,
                store=AsyncMemoryStore(),
                in_progress_status=in_progress_status,
                mismatch_status=mismatch_status,
                replay_status_200=True,
            )
        ],
    )
    waits: list[float] = []

    def sleep(seconds: float) -> None:
        waits.append(seconds)
        gate.set()  # the duplicate was told to wait: now let the first finish

    policy = RetryPolicy(sleep=sleep, backoff_base=0.01)
    key = new_key()
    with uvicorn_server(app) as base, httpx.Client(base_url=base, timeout=10) as plain:
        first: dict[str, httpx.Response] = {}
        thread = threading.Thread(
            target=lambda: first.update(
                answer=plain.post("/pay", json={"n": 1}, headers={"Idempotency-Key": key})
            )
        )
        thread.start()
        assert started.wait(10)
        transport = IdempotentTransport(policy=policy)
        with httpx.Client(transport=transport, base_url=base, timeout=10) as client:
            duplicate = client.post("/pay", json={"n": 1}, headers={"Idempotency-Key": key})
            thread.join(10)
            assert first["answer"].status_code == 201
            assert duplicate.status_code == 200
            assert duplicate.content == first["answer"].content
            assert duplicate.extensions["idempotency_attempts"] >= 2
            assert waits
            assert waits[0] >= 1  # the server's Retry-After, not a backoff
            mismatch = client.post("/pay", json={"n": 2}, headers={"Idempotency-Key": key})
    assert mismatch.status_code == mismatch_status
    assert mismatch.extensions["idempotency_attempts"] == 1
    assert runs["pay"] == 1


# --- the pieces ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        {"in_progress_status": 200},
        {"mismatch_status": 400},
        {"include": ["api/*"]},
        {"exclude": [b"/x"]},
    ],
)
def test_impossible_options_are_refused_when_the_middleware_is_made(
    options: dict[str, Any],
) -> None:
    from idempo import ConfigurationError

    with pytest.raises(ConfigurationError):
        IdempotencyMiddleware(lambda *a: None, store=AsyncMemoryStore(), **options)


def test_a_mark_is_found_through_what_frameworks_wrap_views_in() -> None:
    import functools

    from idempo.http import rule_of

    @not_idempotent
    def view(request: Any) -> None: ...

    @functools.wraps(view)
    def wrapped(request: Any) -> None: ...

    class View:
        def post(self, request: Any) -> None: ...

    def as_view(request: Any) -> None: ...

    as_view.view_class = not_idempotent(View)  # type: ignore[attr-defined]
    assert rule_of(wrapped) == rule_of(view) == RouteRule(guarded=False)
    assert rule_of(as_view) == RouteRule(guarded=False)
    assert rule_of(lambda: None) is None
    with pytest.raises(TypeError, match="takes no attributes"):
        idempotent(len)


def test_key_hooks_for_webhook_senders() -> None:
    from types import SimpleNamespace

    from idempo import InvalidKeyError
    from idempo.http import header_key

    stripe = json_field("id")
    assert stripe(SimpleNamespace(body=b'{"id": "evt_1"}')) == "evt_1"
    assert stripe(SimpleNamespace(body=b'{"id": 42}')) == "42"
    deep, huge = b"[" * 100_000 + b"]" * 100_000, b'{"id": 1' + b"0" * 5_000 + b"}"
    odd = (b"", b"[]", b'{"id": null}', b'{"id": true}', b'{"id": {"a": 1}}', b"\xff", deep, huge)
    for body in odd:
        assert stripe(SimpleNamespace(body=body)) is None
    github = header_key("X-GitHub-Delivery")
    assert github(SimpleNamespace(headers=[(b"x-github-delivery", b'"d-1"')])) == "d-1"
    assert github(SimpleNamespace(headers=[])) is None
    with pytest.raises(InvalidKeyError):
        github(SimpleNamespace(headers=[(b"x-github-delivery", b'"open')]))
    with pytest.raises(ValueError, match="names of the fields"):
        json_field()
