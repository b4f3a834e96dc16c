"""Who asked (SPEC §1), through every HTTP adapter with the framework's own session auth:
two signed-in users of a cookie-session app never get each other's answer, a resolver that
cannot tell is refused, and an anonymous request with cookies is warned of once.

Each site is a real app on a real SQLite store: Starlette's ``AuthenticationMiddleware``
over ``SessionMiddleware``, Litestar's ``SessionAuth``, Flask with Flask-Login, Flask with its
plain session and the documented ``principal=`` recipe, and Django's ``django.contrib.auth``
sessions. Alice and Bob send the same natural key and body.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import sqlite3
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import django_setup  # noqa: F401 - configures Django before its modules are imported

# isort: split
from django.contrib.auth.models import User as DjangoUser
from django.core.management import call_command
from django.http import HttpRequest as DjangoRequest
from django.http import HttpResponse as DjangoResponse
from django.http import JsonResponse as DjangoJson
from django.test import Client as DjangoClient
from django.test import override_settings
from django.urls import path as django_path
from flask import Flask, jsonify, session
from flask import request as flask_request
from litestar import Litestar, Request, get, post
from litestar.middleware import DefineMiddleware
from litestar.middleware.session.server_side import ServerSideSessionConfig
from litestar.params import FromPath
from litestar.security.session_auth import SessionAuth
from litestar.testing import TestClient as LitestarClient
from starlette.applications import Starlette
from starlette.authentication import (
    AuthCredentials,
    AuthenticationBackend,
    BaseUser,
    SimpleUser,
)
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.middleware.sessions import SessionMiddleware
from starlette.requests import HTTPConnection
from starlette.requests import Request as StarletteRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.testclient import TestClient as StarletteClient

from idempo.asgi import IdempotencyMiddleware
from idempo.stores.sqlite import AsyncSQLiteStore, SQLiteStore
from idempo.wsgi import IdempotencyWSGIMiddleware

KEY = "subscription:2026-12"  # a natural key: every user's December subscription
BODY = {"plan": "pro"}
SECRET = "test-only-secret-0123456789abcdef"


@dataclass(frozen=True)
class Answer:
    """A response from any framework's test client, in one shape."""

    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def replayed(self) -> bool:
        return self.headers.get("idempotent-replayed") == "true"

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class Site:
    """One framework's app behind idempo: how to sign in, post, and read what ran."""

    kind: str
    db: Path
    sign_in: Callable[[str | None], Any]  # a client with a session for that user (None: none)
    send: Callable[[Any, str, str, dict[str, str]], Answer]
    open_path: str = "/subscriptions"  # where a request without a session reaches idempo
    runs: list[str | None] = field(default_factory=list)  # the user each execution saw

    def subscribe(self, client: Any, key: str = KEY, **headers: str) -> Answer:
        return self.send(client, "/subscriptions", key, headers)

    def subscribe_open(self, client: Any, key: str = KEY, **headers: str) -> Answer:
        return self.send(client, self.open_path, key, headers)

    def records(self) -> list[tuple[str, str, str]]:
        """(principal, key, state) of every record in the store."""
        with sqlite3.connect(self.db) as conn:
            rows = conn.execute("SELECT principal, idem_key, state FROM idempo_records").fetchall()
        return sorted(rows)


def _answer(status: int, headers: Any, body: bytes) -> Answer:
    return Answer(status, {name.lower(): value for name, value in headers.items()}, body)


def _executed(runs: list[str | None], user: str | None) -> dict[str, Any]:
    runs.append(user)
    return {"user": user, "plan": BODY["plan"], "execution": len(runs)}


# --- Starlette: AuthenticationMiddleware over a session cookie ----------------------------


class SessionBackend(AuthenticationBackend):
    """Signed-in users are the ones whose (signed) session cookie names them."""

    async def authenticate(self, conn: HTTPConnection) -> tuple[AuthCredentials, BaseUser] | None:
        name = conn.session.get("user")
        if name is None:
            return None
        return AuthCredentials(["authenticated"]), SimpleUser(name)


def starlette_site(db: Path, user_class: type[BaseUser] = SimpleUser, **options: Any) -> Site:
    runs: list[str | None] = []
    store = AsyncSQLiteStore(str(db))

    async def login(request: StarletteRequest) -> Response:
        request.session["user"] = request.path_params["name"]
        return PlainTextResponse("signed in")

    async def subscribe(request: StarletteRequest) -> Response:
        user = request.user.display_name if request.user.is_authenticated else None
        return JSONResponse(_executed(runs, user), status_code=201)

    class Backend(SessionBackend):
        async def authenticate(
            self, conn: HTTPConnection
        ) -> tuple[AuthCredentials, BaseUser] | None:
            found = await super().authenticate(conn)
            if found is None or user_class is SimpleUser:
                return found
            return found[0], user_class()

    app = Starlette(
        routes=[
            Route("/login/{name}", login),
            Route("/subscriptions", subscribe, methods=["POST"]),
        ],
        middleware=[
            Middleware(SessionMiddleware, secret_key=SECRET),
            Middleware(AuthenticationMiddleware, backend=Backend()),
            Middleware(IdempotencyMiddleware, store=store, **options),
        ],
    )

    def sign_in(name: str | None) -> StarletteClient:
        client = StarletteClient(app)
        if name is not None:
            assert client.get(f"/login/{name}").status_code == 200
        return client

    def send(client: Any, path: str, key: str, headers: dict[str, str]) -> Answer:
        response = client.post(path, json=BODY, headers={"Idempotency-Key": key, **headers})
        return _answer(response.status_code, response.headers, response.content)

    return Site("starlette", db, sign_in, send, runs=runs)


# --- Litestar: SessionAuth ----------------------------------------------------------------


@dataclass(frozen=True)
class LitestarUser:
    """An app's own user class, as Litestar apps have: idempo finds its ``id``."""

    id: str
    name: str


def litestar_site(db: Path, **options: Any) -> Site:
    runs: list[str | None] = []
    store = AsyncSQLiteStore(str(db))

    async def retrieve_user(session: dict[str, Any], connection: Any) -> LitestarUser | None:
        name = session.get("user")
        return None if name is None else LitestarUser(id=f"id-{name}", name=name)

    auth = SessionAuth[LitestarUser, Any](
        retrieve_user_handler=retrieve_user,
        session_backend_config=ServerSideSessionConfig(),  # a session id cookie
        exclude=["/login", "/open"],
    )

    @get("/login/{name:str}", sync_to_thread=False)
    def login(request: Request[Any, Any, Any], name: FromPath[str]) -> str:
        request.set_session({"user": name})
        return "signed in"

    @post(["/subscriptions", "/open/subscriptions"], status_code=201, sync_to_thread=False)
    def subscribe(request: Request[Any, Any, Any]) -> dict[str, Any]:
        user = request.scope.get("user")
        return _executed(runs, user.name if user is not None else None)

    app = Litestar(
        route_handlers=[login, subscribe],
        on_app_init=[auth.on_app_init],
        logging_config=None,  # Litestar's own would replace the handlers caplog reads
        middleware=[DefineMiddleware(IdempotencyMiddleware, store=store, **options)],
    )

    def sign_in(name: str | None) -> LitestarClient[Litestar]:
        client = LitestarClient(app)
        if name is not None:
            assert client.get(f"/login/{name}").status_code == 200
        return client

    def send(client: Any, path: str, key: str, headers: dict[str, str]) -> Answer:
        response = client.post(path, json=BODY, headers={"Idempotency-Key": key, **headers})
        return _answer(response.status_code, response.headers, response.content)

    return Site("litestar", db, sign_in, send, open_path="/open/subscriptions", runs=runs)


# --- Flask: Flask-Login, and a plain session with the principal= recipe --------------------


def _flask_send(client: Any, path: str, key: str, headers: dict[str, str]) -> Answer:
    cookie = headers.pop("Cookie", None)
    if cookie is not None:  # Werkzeug's client sends its own jar, not a Cookie header
        name, _, value = cookie.partition("=")
        client.set_cookie(name, value)
    response = client.post(path, json=BODY, headers={"Idempotency-Key": key, **headers})
    return _answer(response.status_code, response.headers, response.data)


def flask_login_site(db: Path, **options: Any) -> Site:
    try:
        flask_login = importlib.import_module("flask_login")
    except ImportError:
        message = "Flask-Login is not installed (the dev group brings it)"
        if os.environ.get("IDEMPO_TEST_REQUIRE_ALL") == "1":
            pytest.fail(message)
        pytest.skip(message)
    runs: list[str | None] = []
    app = Flask(__name__)
    app.secret_key = SECRET
    manager = flask_login.LoginManager(app)

    class FlaskUser(flask_login.UserMixin):
        def __init__(self, name: str) -> None:
            self.id = name

    @manager.user_loader
    def load_user(user_id: str) -> FlaskUser:
        return FlaskUser(user_id)

    @app.get("/login/<name>")
    def login(name: str) -> str:
        flask_login.login_user(FlaskUser(name))
        return "signed in"

    @app.post("/subscriptions")
    def subscribe() -> Any:
        user = flask_login.current_user
        return jsonify(_executed(runs, user.id if user.is_authenticated else None)), 201

    app.wsgi_app = IdempotencyWSGIMiddleware(  # type: ignore[method-assign]
        app.wsgi_app, store=SQLiteStore(str(db)), **options
    )

    def sign_in(name: str | None) -> Any:
        client = app.test_client()
        if name is not None:
            assert client.get(f"/login/{name}").status_code == 200
        return client

    return Site("flask-login", db, sign_in, _flask_send, runs=runs)


def flask_session_site(db: Path, **options: Any) -> Site:
    """A Flask app that signs users in with its plain session, and the principal= recipe
    docs/http.md gives for it: read the session in a request context of the environ."""
    runs: list[str | None] = []
    app = Flask(__name__)
    app.secret_key = SECRET

    def principal(environ: dict[str, Any]) -> str | None:
        with app.request_context(environ):
            user = session.get("user")
        return None if user is None else f"user:{user}"

    @app.get("/login/<name>")
    def login(name: str) -> str:
        session["user"] = name
        return "signed in"

    @app.post("/subscriptions")
    def subscribe() -> Any:
        assert flask_request.get_json() == BODY  # the body still reaches the view
        return jsonify(_executed(runs, session.get("user"))), 201

    options.setdefault("principal", principal)
    app.wsgi_app = IdempotencyWSGIMiddleware(  # type: ignore[method-assign]
        app.wsgi_app, store=SQLiteStore(str(db)), **options
    )

    def sign_in(name: str | None) -> Any:
        client = app.test_client()
        if name is not None:
            assert client.get(f"/login/{name}").status_code == 200
        return client

    return Site("flask-session", db, sign_in, _flask_send, runs=runs)


# --- Django: django.contrib.auth sessions -------------------------------------------------

django_runs: list[str | None] = []


def django_subscribe(request: DjangoRequest) -> DjangoResponse:
    user = request.user.get_username() if request.user.is_authenticated else None
    return DjangoJson(_executed(django_runs, user), status=201)


urlpatterns = [django_path("subscriptions", django_subscribe)]

_DJANGO_OPTIONS = {"principal": "PRINCIPAL", "allow_anonymous": "ALLOW_ANONYMOUS"}


@pytest.fixture(scope="module")
def django_users() -> None:
    """Django's auth tables (in memory) with Alice and Bob."""
    call_command("migrate", verbosity=0)
    for name in ("alice", "bob"):
        DjangoUser.objects.get_or_create(username=name)


def django_site(db: Path, stack: Any, **options: Any) -> Site:
    django_runs.clear()
    idempo = {"STORE": SQLiteStore(str(db))}
    idempo.update({_DJANGO_OPTIONS[name]: value for name, value in options.items()})
    stack(
        override_settings(
            ROOT_URLCONF=__name__,
            MIDDLEWARE=[
                "django.contrib.sessions.middleware.SessionMiddleware",
                "django.contrib.auth.middleware.AuthenticationMiddleware",
                "idempo.contrib.django.IdempotencyMiddleware",
            ],
            IDEMPO=idempo,
        )
    )

    def sign_in(name: str | None) -> DjangoClient:
        client = DjangoClient()
        if name is not None:
            client.force_login(DjangoUser.objects.get(username=name))
        return client

    def send(client: Any, path: str, key: str, headers: dict[str, str]) -> Answer:
        response = client.post(
            path, BODY, content_type="application/json", headers={"Idempotency-Key": key, **headers}
        )
        return _answer(response.status_code, response.headers, response.content)

    return Site("django", db, sign_in, send, runs=django_runs)


# --- fixtures -----------------------------------------------------------------------------

SITES = ["starlette", "litestar", "flask-login", "flask-session", "django"]
MakeSite = Callable[..., Site]


@pytest.fixture(params=SITES)
def make_site(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[..., Site]]:
    """Builds the parametrized framework's site with the given middleware options."""
    kind: str = request.param
    db = tmp_path / "idempo.db"
    migrated = SQLiteStore(str(db))
    migrated.migrate()
    migrated.close()
    contexts: list[Any] = []

    def enter(context: Any) -> None:
        context.__enter__()
        contexts.append(context)

    def make(**options: Any) -> Site:
        if kind == "django":
            request.getfixturevalue("django_users")
            return django_site(db, enter, **options)
        builders: dict[str, Callable[..., Site]] = {
            "starlette": starlette_site,
            "litestar": litestar_site,
            "flask-login": flask_login_site,
            "flask-session": flask_session_site,
        }
        return builders[kind](db, **options)

    yield make
    for context in reversed(contexts):
        context.__exit__(None, None, None)


# --- the tests ----------------------------------------------------------------------------


def test_signed_in_users_never_get_each_others_answer(make_site: MakeSite) -> None:
    """Alice and Bob, signed in by the framework's session cookie, send one natural key and
    one body: Bob's request runs and gets his own answer; each one's retry replays their own."""
    site = make_site()
    alice, bob = site.sign_in("alice"), site.sign_in("bob")
    first = site.subscribe(alice)
    theirs = site.subscribe(bob)
    assert first.status == theirs.status == 201, (first, theirs)
    assert not theirs.replayed
    assert theirs.json()["user"] == "bob"
    assert site.runs == ["alice", "bob"]
    again = site.subscribe(alice)
    assert again.replayed
    assert again.body == first.body
    assert site.subscribe(bob).body == theirs.body
    principals = {principal for principal, _, _ in site.records()}
    assert len(principals) == 2
    assert "" not in principals


def test_a_resolver_that_cannot_tell_is_refused(make_site: MakeSite) -> None:
    """principal= returning None is a 401 problem: nothing runs, nothing is stored."""
    site = make_site(principal=lambda request: None)
    refused = site.subscribe_open(site.sign_in(None))
    assert refused.status == 401
    assert refused.headers["content-type"] == "application/problem+json"
    assert refused.json()["type"] == "urn:idempo:problem:principal-required"
    assert site.runs == []
    assert site.records() == []


def test_allow_anonymous_lets_a_none_principal_run_anonymously(make_site: MakeSite) -> None:
    """With allow_anonymous=True a resolver's None means the default principal, which for a
    request with no user and no Authorization is anonymous."""
    site = make_site(principal=lambda request: None, allow_anonymous=True)
    answer = site.subscribe_open(site.sign_in(None))
    assert answer.status == 201
    assert site.records() == [("", KEY, "completed")]


def test_an_empty_principal_is_anonymous_by_choice(make_site: MakeSite) -> None:
    """A resolver's "" is the app saying "anonymous": the request runs, and anonymous callers
    share one key space."""
    site = make_site(principal=lambda request: "")
    assert site.subscribe_open(site.sign_in(None)).status == 201
    assert site.subscribe_open(site.sign_in(None)).replayed
    assert site.records() == [("", KEY, "completed")]


def test_cookies_without_a_principal_are_warned_of_once(
    make_site: MakeSite, caplog: pytest.LogCaptureFixture
) -> None:
    """With no resolver, an anonymous request that carries cookies (most likely a session
    idempo cannot see: on the plain-session Flask site, it cannot see any) runs, and the
    middleware says so once; allow_anonymous=True says anonymous is meant."""
    site = make_site(principal=None)
    client = site.sign_in(None)  # one client: Django makes a middleware per client handler
    with caplog.at_level(logging.WARNING, logger="idempo.http"):
        for key in ("k-1", "k-2"):
            answer = site.subscribe_open(client, key=key, Cookie="theme=dark")
            assert answer.status == 201
    warned = [r for r in caplog.records if "principal=" in r.getMessage()]
    assert len(warned) == 1, caplog.text
    caplog.clear()
    quiet = make_site(principal=None, allow_anonymous=True)
    with caplog.at_level(logging.WARNING, logger="idempo.http"):
        quiet.subscribe_open(quiet.sign_in(None), key="k-3", Cookie="theme=dark")
    assert not [r for r in caplog.records if "principal=" in r.getMessage()]


def test_a_refreshed_bearer_token_is_a_new_principal_unless_the_app_names_it(
    tmp_path: Path,
) -> None:
    """By default the principal is a hash of Authorization, so a client that refreshes its
    token between retries executes again; docs/http.md's recipe names the token's subject."""
    db = tmp_path / "idempo.db"
    SQLiteStore(str(db)).migrate()
    default = starlette_site(db)
    client = default.sign_in(None)
    default.subscribe(client, Authorization="Bearer alice.token-1")
    assert not default.subscribe(client, Authorization="Bearer alice.token-2").replayed
    assert len(default.runs) == 2

    def subject(scope: dict[str, Any]) -> str | None:
        # Stands for verifying the token and reading its "sub" claim.
        value = dict(scope["headers"]).get(b"authorization", b"").decode()
        return f"sub:{value.removeprefix('Bearer ').split('.')[0]}" if value else None

    named = starlette_site(tmp_path / "idempo.db", principal=subject)
    client = named.sign_in(None)
    named.subscribe(client, key="k-refresh", Authorization="Bearer alice.token-1")
    assert named.subscribe(client, key="k-refresh", Authorization="Bearer alice.token-2").replayed
    assert len(named.runs) == 1


def test_an_authenticated_user_idempo_cannot_identify_is_a_clear_500(tmp_path: Path) -> None:
    """A framework user with no id idempo knows is refused with a problem naming principal=,
    never run under a principal shared by every such user."""

    class Nameless(BaseUser):
        @property
        def is_authenticated(self) -> bool:
            return True

    db = tmp_path / "idempo.db"
    SQLiteStore(str(db)).migrate()
    site = starlette_site(db, user_class=Nameless)
    answer = site.subscribe(site.sign_in("alice"))
    assert answer.status == 500
    assert "principal=" in answer.json()["detail"]
    assert site.runs == []
    assert site.records() == []
