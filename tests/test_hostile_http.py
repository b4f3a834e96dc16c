"""Hostile requests through every HTTP adapter (SPEC §8): whatever a client sends, idempo
answers with the app's response or its own 4xx problem, never a 5xx, and never leaves a
record but for a request that reached the endpoint and got an answer that is stored.

The requests are made by hypothesis (deep nesting, huge numbers, invalid UTF-8, lone
surrogates, duplicate keys, odd content types, repeated and odd ``Idempotency-Key`` values,
odd header bytes) and handed to each app as raw ASGI messages or a raw WSGI environ, so no
test client tidies them first. Each one is sent twice: the second must be the replay of the
first, or the same refusal. Also here: deeply nested JSON (defect #9) and a stored record
that cannot be decoded (a 503 ``corrupt-record`` problem, the app not run).
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import logging
import os
import sqlite3
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import django_setup  # noqa: F401 - configures Django before its modules are imported

# isort: split
from django.core.handlers.wsgi import WSGIHandler
from django.http import HttpRequest as DjangoRequest
from django.http import HttpResponse as DjangoResponse
from django.test import override_settings
from django.urls import path as django_path
from fastapi import FastAPI
from flask import Flask
from flask import request as flask_request
from litestar import Litestar
from litestar import Request as LitestarRequest
from litestar import Response as LitestarResponse
from litestar import post as litestar_post
from litestar.middleware import DefineMiddleware
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from idempo import Idempotency, InvalidKeyError, InvalidPayloadError, validate_key
from idempo._http import canonical_parts, parse_key
from idempo.asgi import ATTEMPT_SCOPE_KEY, IdempotencyMiddleware
from idempo.errors import ConfigurationError
from idempo.events import key_digest
from idempo.http import json_field
from idempo.stores.postgres import AsyncPostgresStore
from idempo.stores.sqlite import AsyncSQLiteStore, SQLiteStore
from idempo.wsgi import ATTEMPT_ENVIRON_KEY, IdempotencyWSGIMiddleware

BODY_LIMIT = 64 * 1024
DEEP = 500  # defect #9: about 500 levels, 1.2 KB, and json.loads accepts it


# --- the endpoint, the same in every framework --------------------------------------------


@dataclass
class Endpoint:
    """What reached the app: each request's Idempotency-Key values, body and answer."""

    reached: list[tuple[list[bytes], bytes, int]] = field(default_factory=list)

    def answer(self, keys: list[bytes], body: bytes, attempt: Any = None) -> tuple[int, bytes]:
        """201 with the body's digest, or the app's own deterministic 422 for a body that
        starts with ``reject``, or a 400 it says not to store (`Attempt.do_not_store`) for
        one that starts with ``unkept``. Never a 5xx: any 5xx a test sees is idempo's."""
        status = 422 if body.startswith(b"reject") else 201
        if body.startswith(b"unkept"):
            attempt.do_not_store()
            status = 400
        self.reached.append((keys, body, status))
        digest = hashlib.sha256(body).hexdigest()
        return status, json.dumps({"n": len(self.reached), "sha256": digest}).encode()


def _keys_of(values: list[str] | None) -> list[bytes]:
    return [value.encode("latin-1") for value in values or []]


def starlette_app(endpoint: Endpoint, store: Any, **options: Any) -> Any:
    async def items(request: Request) -> Response:
        keys = _keys_of(request.headers.getlist("idempotency-key"))
        attempt = request.scope.get(ATTEMPT_SCOPE_KEY)
        status, content = endpoint.answer(keys, await request.body(), attempt)
        return Response(content, status_code=status, media_type="application/json")

    return Starlette(
        routes=[Route("/items", items, methods=["POST"])],
        middleware=[
            Middleware(
                IdempotencyMiddleware,
                store=store,
                max_request_bytes=BODY_LIMIT,
                allow_anonymous=True,
                **options,
            )
        ],
    )


def fastapi_app(endpoint: Endpoint, store: Any, **options: Any) -> Any:
    app = FastAPI()

    @app.post("/items")
    async def items(request: Request) -> Response:
        keys = _keys_of(request.headers.getlist("idempotency-key"))
        attempt = request.scope.get(ATTEMPT_SCOPE_KEY)
        status, content = endpoint.answer(keys, await request.body(), attempt)
        return Response(content, status_code=status, media_type="application/json")

    app.add_middleware(
        IdempotencyMiddleware,
        store=store,
        max_request_bytes=BODY_LIMIT,
        allow_anonymous=True,
        **options,
    )
    return app


def litestar_app(endpoint: Endpoint, store: Any, **options: Any) -> Any:
    @litestar_post("/items")
    async def items(request: LitestarRequest[Any, Any, Any]) -> LitestarResponse[bytes]:
        keys = _keys_of(request.headers.getall("idempotency-key", []))
        attempt = request.scope.get(ATTEMPT_SCOPE_KEY)
        status, content = endpoint.answer(keys, await request.body(), attempt)
        return LitestarResponse(content, status_code=status, media_type="application/json")

    return Litestar(
        route_handlers=[items],
        middleware=[
            DefineMiddleware(
                IdempotencyMiddleware,
                store=store,
                max_request_bytes=BODY_LIMIT,
                allow_anonymous=True,
                **options,
            )
        ],
        logging_config=None,
    )


def flask_app(endpoint: Endpoint, store: Any, **options: Any) -> Any:
    app = Flask(__name__)

    @app.post("/items")
    def items() -> Any:
        keys = _keys_of(flask_request.headers.getlist("Idempotency-Key"))
        attempt = flask_request.environ.get(ATTEMPT_ENVIRON_KEY)
        status, content = endpoint.answer(keys, flask_request.get_data(), attempt)
        return content, status, {"Content-Type": "application/json"}

    app.wsgi_app = IdempotencyWSGIMiddleware(  # type: ignore[method-assign]
        app.wsgi_app, store=store, max_request_bytes=BODY_LIMIT, allow_anonymous=True, **options
    )
    return app


django_endpoint = Endpoint()


def django_items(request: DjangoRequest) -> DjangoResponse:
    value = request.META.get("HTTP_IDEMPOTENCY_KEY")
    keys = [] if value is None else [value.encode("latin-1")]
    attempt = getattr(request, "idempo_attempt", None)
    status, content = django_endpoint.answer(keys, request.body, attempt)
    return DjangoResponse(content, status=status, content_type="application/json")


urlpatterns = [django_path("items", django_items)]


# --- raw drivers: no test client tidies the request ---------------------------------------


@dataclass(frozen=True)
class Sent:
    """One hostile request."""

    keys: list[bytes]  # Idempotency-Key values, each its own header line where that exists
    headers: list[tuple[bytes, bytes]]  # the others (names lowercase)
    body: bytes
    query: bytes
    chunks: int  # how many ASGI body messages the body arrives in


@dataclass(frozen=True)
class Got:
    status: int
    headers: dict[bytes, bytes]
    body: bytes

    @property
    def replayed(self) -> bool:
        return self.headers.get(b"idempotent-replayed") == b"true"


async def call_asgi(app: Any, sent: Sent) -> Got:
    headers = [(b"host", b"testserver")]
    headers += [(b"idempotency-key", value) for value in sent.keys]
    headers += [*sent.headers, (b"content-length", str(len(sent.body)).encode())]
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/items",
        "raw_path": b"/items",
        "root_path": "",
        "query_string": sent.query,
        "headers": headers,
        "client": ("127.0.0.1", 50000),
        "server": ("testserver", 80),
        "state": {},
    }
    size = max(1, -(-len(sent.body) // sent.chunks))
    parts = [sent.body[i : i + size] for i in range(0, len(sent.body), size)] or [b""]
    messages = [
        {"type": "http.request", "body": part, "more_body": index < len(parts) - 1}
        for index, part in enumerate(parts)
    ]
    done = asyncio.Event()

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        await done.wait()  # the client stays until its response is whole
        return {"type": "http.disconnect"}

    start: dict[str, Any] = {}
    body: list[bytes] = []

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            start.update(message)
        elif message["type"] == "http.response.body":
            body.append(message.get("body", b""))
            if not message.get("more_body", False):
                done.set()

    await app(scope, receive, send)
    return Got(int(start["status"]), dict(start.get("headers", [])), b"".join(body))


def call_wsgi(app: Any, sent: Sent) -> Got:
    environ: dict[str, Any] = {
        "REQUEST_METHOD": "POST",
        "SCRIPT_NAME": "",
        "PATH_INFO": "/items",
        "QUERY_STRING": sent.query.decode("latin-1"),
        "SERVER_NAME": "testserver",
        "SERVER_PORT": "80",
        "SERVER_PROTOCOL": "HTTP/1.1",
        "HTTP_HOST": "testserver",
        "CONTENT_LENGTH": str(len(sent.body)),
        "wsgi.version": (1, 0),
        "wsgi.url_scheme": "http",
        "wsgi.input": io.BytesIO(sent.body),
        "wsgi.errors": sys.stderr,
        "wsgi.multithread": True,
        "wsgi.multiprocess": False,
        "wsgi.run_once": False,
    }
    fields: dict[str, list[bytes]] = {}
    if sent.keys:
        fields["HTTP_IDEMPOTENCY_KEY"] = sent.keys
    for name, value in sent.headers:
        text = name.decode("latin-1").upper().replace("-", "_")
        fields.setdefault(text if text == "CONTENT_TYPE" else f"HTTP_{text}", []).append(value)
    # A WSGI server joins a header sent twice into one value (PEP 3333, RFC 9110 §5.3).
    environ.update({name: b",".join(values).decode("latin-1") for name, values in fields.items()})
    status: list[str] = []
    headers: list[tuple[str, str]] = []

    def start_response(line: str, given: list[tuple[str, str]], exc_info: Any = None) -> Any:
        status[:] = [line]
        headers[:] = given
        return lambda data: None

    result = app(environ, start_response)
    try:
        body = b"".join(result)
    finally:
        close = getattr(result, "close", None)
        if close is not None:
            close()
    return Got(
        int(status[0].split()[0]),
        {name.lower().encode("latin-1"): value.encode("latin-1") for name, value in headers},
        body,
    )


# --- the sites: one per adapter, on a real store ------------------------------------------


@dataclass
class Site:
    kind: str
    endpoint: Endpoint
    call: Callable[[Sent], Got]
    records: Callable[[], list[tuple[str, str]]]  # (key, state) of every stored record
    clear: Callable[[], None]
    wsgi: bool = False  # a header sent twice arrives as one value, joined with a comma
    # Where the site's middleware finds a key when not in the header (its ``key_from``).
    key_from: Callable[[Sent], str | None] | None = None

    def key(self, sent: Sent) -> str | None:
        """The key idempo read from the request, as the adapter hands the header over."""
        if self.key_from is not None:
            return self.key_from(sent)
        return parse_key([b",".join(sent.keys)] if self.wsgi and sent.keys else sent.keys)


def sqlite_records(db: Path) -> Callable[[], list[tuple[str, str]]]:
    def records() -> list[tuple[str, str]]:
        with sqlite3.connect(db) as conn:
            return sorted(conn.execute("SELECT idem_key, state FROM idempo_records").fetchall())

    return records


def sqlite_clear(db: Path) -> Callable[[], None]:
    def clear() -> None:
        with sqlite3.connect(db) as conn:
            conn.execute("DELETE FROM idempo_records")

    return clear


ASGI_APPS = {"starlette": starlette_app, "fastapi": fastapi_app, "litestar": litestar_app}
SITES = ["starlette", "fastapi", "litestar", "flask", "django"]


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """One event loop for a whole test: the async stores' pools belong to it."""
    loop = asyncio.new_event_loop()
    try:
        yield loop
    finally:
        loop.close()


MakeSite = Callable[..., Site]


@pytest.fixture(params=SITES)
def make_site(
    request: pytest.FixtureRequest, tmp_path: Path, loop: asyncio.AbstractEventLoop
) -> Iterator[MakeSite]:
    """Makes the parametrized adapter's app, with the given middleware options, on a fresh
    SQLite file."""
    kind: str = request.param
    db = tmp_path / "idempo.db"
    store = SQLiteStore(str(db))
    store.migrate()
    records, clear = sqlite_records(db), sqlite_clear(db)
    contexts: list[Any] = []

    def make(**options: Any) -> Site:
        clear()
        if kind in ASGI_APPS:
            endpoint = Endpoint()
            app = ASGI_APPS[kind](endpoint, AsyncSQLiteStore(str(db)), **options)
            return Site(
                kind,
                endpoint,
                lambda sent: loop.run_until_complete(call_asgi(app, sent)),
                records,
                clear,
            )
        if kind == "flask":
            endpoint = Endpoint()
            wsgi = flask_app(endpoint, store, **options).wsgi_app
            return Site(kind, endpoint, lambda sent: call_wsgi(wsgi, sent), records, clear, True)
        django_endpoint.reached.clear()
        settings = {"STORE": store, "MAX_REQUEST_BYTES": BODY_LIMIT, "ALLOW_ANONYMOUS": True}
        settings.update({name.upper(): value for name, value in options.items()})
        context = override_settings(
            ROOT_URLCONF=__name__,
            MIDDLEWARE=["idempo.contrib.django.IdempotencyMiddleware"],
            IDEMPO=settings,
        )
        context.__enter__()
        contexts.append(context)
        handler = WSGIHandler()
        return Site(
            kind, django_endpoint, lambda sent: call_wsgi(handler, sent), records, clear, True
        )

    yield make
    for context in reversed(contexts):
        context.__exit__(None, None, None)
    store.close()


@pytest.fixture
def site(make_site: MakeSite) -> Site:
    """The parametrized adapter's app with the default options."""
    return make_site()


@pytest.fixture
def pg_site(postgres_url: str, pg_schema: str, loop: asyncio.AbstractEventLoop) -> Iterator[Site]:
    """Starlette on the PostgreSQL store: the one case on a server."""
    table = f"{pg_schema}.idempo_records"
    store = AsyncPostgresStore(postgres_url, table=table, max_size=4)
    loop.run_until_complete(store.migrate())
    endpoint = Endpoint()
    app = starlette_app(endpoint, store)

    def records() -> list[tuple[str, str]]:
        with psycopg.connect(postgres_url) as conn:
            rows = conn.execute(f"SELECT idem_key, state FROM {table}").fetchall()
        return sorted((key, state) for key, state in rows)

    def clear() -> None:
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            conn.execute(f"DELETE FROM {table}")

    yield Site(
        "starlette-postgres",
        endpoint,
        lambda sent: loop.run_until_complete(call_asgi(app, sent)),
        records,
        clear,
    )
    loop.run_until_complete(store.aclose())


# --- hostile requests ---------------------------------------------------------------------

_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4)
    ),
    max_leaves=12,
)


def _nested(depth: int, shape: str) -> bytes:
    if shape == "array":
        return b"[" * depth + b"]" * depth
    if shape == "object":
        return b'{"a":' * depth + b"1.5" + b"}" * depth
    return b'[{"a":' * depth + b"1e400" + b"}]" * depth


_NESTED = st.builds(
    _nested,
    st.one_of(st.integers(1, 40), st.just(DEEP), st.integers(900, 4000)),
    st.sampled_from(["array", "object", "mixed"]),
)
BODIES = st.one_of(
    _NESTED,
    _NESTED,
    st.sampled_from(
        [
            b"1e400",
            b"-1e400",
            b'{"n": 1e400}',
            b"9" * 5000,
            b'{"n": ' + b"9" * 5000 + b"}",
            b'{"n": ' + b"1" * 4300 + b"}",
            b'"\\ud800"',
            b'{"\\udc00": 1}',
            b'{"a": "\\ud83d"}',
            b'{"a":1,"a":2}',
            b'{"a":2}',
            b"\xff\xfe{",
            b"\xc3\x28",
            b'{"a": "\xed\xa0\x80"}',
            b"\xef\xbb\xbf{}",
            b'\x00{"a":1}',
            b"",
            b"null",
            b"NaN",
            b'{"a": NaN}',
            b"Infinity",
            b"reject",
            b'reject{"a":1}',
            b"x" * (BODY_LIMIT + 1),
        ]
    ),
    _json.map(lambda value: json.dumps(value).encode()),
    _json.map(lambda value: json.dumps(value, ensure_ascii=False).encode("utf-16")),
    st.binary(max_size=200),
)

KEY_VALUES = st.one_of(
    st.sampled_from(
        [
            b"k-1",
            b'"k-1"',
            b'"a\\"b"',
            b'"a\\\\b"',
            b'"a\\nb"',
            b'"abc',
            b'"a" b',
            b'"abc";p=1',
            b'"abc";p',
            b"?1",
            b"42",
            b":aGk=:",
            b'"',
            b"",
            b"   ",
            b"\t k-1 \t",
            b"k" * 255,
            b"k" * 256,
            b'"' + b"k" * 255 + b'"',
            b'"' + b"k" * 256 + b'"',
            b"a\x01b",
            b"a\x7fb",
            b"a\x00",
            b"\xff\xfe",
            b"caf\xc3\xa9",
            b'"caf\xc3\xa9"',
            b"a b",
            b"k-1, k-2",
        ]
    ),
    st.binary(max_size=40),
    st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=260).map(
        str.encode
    ),
)

_JSON_TYPE = st.just(b"application/json")  # weighted: most hostile bodies claim to be JSON
CONTENT_TYPES = st.one_of(
    _JSON_TYPE,
    _JSON_TYPE,
    _JSON_TYPE,
    st.sampled_from(
        [
            b"application/json",
            b"APPLICATION/JSON",
            b"application/json; charset=latin-1",
            b"application/problem+json",
            b"application/+json",
            b"text/plain",
            b"application/x-www-form-urlencoded",
            b"multipart/form-data; boundary=x",
            b";;;",
            b"\xff\xfe",
        ]
    ),
    st.binary(max_size=30),
)

NAMES = st.sampled_from(
    [b"authorization", b"cookie", b"x-odd", b"x-\xff\xfe", b"content-encoding", b"x-a b"]
)

_PRINTABLE = st.characters(min_codepoint=0x21, max_codepoint=0x7E)
# Keys idempo takes, so that most requests reach the endpoint with their hostile rest: bare
# tokens, and sf-strings with escapes (spaces in one make it a key idempo refuses).
VALID_KEYS = st.one_of(
    st.text(_PRINTABLE, min_size=1, max_size=255).filter(lambda key: key[0] != '"'),
    st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=1, max_size=200).map(
        lambda key: '"' + key.replace("\\", "\\\\").replace('"', '\\"') + '"'
    ),
).map(lambda key: [key.encode()])
KEYS = st.one_of(VALID_KEYS, VALID_KEYS, VALID_KEYS, st.lists(KEY_VALUES, max_size=2))

REQUESTS = st.builds(
    Sent,
    keys=KEYS,
    headers=st.lists(st.tuples(NAMES, st.binary(max_size=30)), max_size=3).flatmap(
        lambda others: st.one_of(
            st.just(others),
            CONTENT_TYPES.map(lambda value: [(b"content-type", value), *others]),
            CONTENT_TYPES.map(lambda value: [*others, (b"content-type", value)]),
        )
    ),
    body=BODIES,
    query=st.one_of(st.just(b""), st.binary(max_size=20)),
    chunks=st.integers(1, 3),
)

# More locally: IDEMPO_HOSTILE_EXAMPLES=2000 pytest tests/test_hostile_http.py
EXAMPLES = settings(
    max_examples=int(os.environ.get("IDEMPO_HOSTILE_EXAMPLES", "60")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def check_exchange(site: Site, sent: Sent) -> None:
    """Send ``sent`` twice; check the answers and that the store holds only what it should."""
    site.clear()
    site.endpoint.reached.clear()
    first = site.call(sent)
    second = site.call(sent)
    assert first.status < 500, (first, sent)
    assert second.status < 500, (second, sent)
    reached = site.endpoint.reached
    event(f"answered {first.status}" + (" by the app" if reached else " by idempo"))
    assert len(reached) <= 1, "a duplicate ran the endpoint again"
    if reached:
        _, body, status = reached[0]
        assert body == sent.body, "the app got another body than the client sent"
        assert first.status == status
        assert not first.replayed
        assert second.replayed, second
        assert (second.status, second.body) == (first.status, first.body)
        # The key the endpoint ran under is the one the store keeps, completed or failed.
        key = site.key(sent)
        expected = "completed" if status < 400 else "failed"
        assert site.records() == [(key, expected)]
    else:
        # Refused by idempo: a problem, the same one twice, and nothing stored.
        assert first.headers.get(b"content-type") == b"application/problem+json", first
        assert json.loads(first.body)["type"].startswith("urn:idempo:problem:")
        assert (second.status, second.body) == (first.status, first.body)
        assert site.records() == []


@EXAMPLES
@given(sent=REQUESTS)
def test_hostile_requests_never_get_a_5xx_nor_leave_a_record(site: Site, sent: Sent) -> None:
    check_exchange(site, sent)


# A webhook keyed by its body (Stripe's event.id): the key is whatever the sender put there.
_EVENT_IDS = st.one_of(
    st.sampled_from([b"42", b"-0", b"1e400", b'"a b"', b'""', b"null", b"true", b"[]", b"{}"]),
    st.sampled_from([b'"' + b"k" * 256 + b'"', b"9" * 300, b'"\\ud800"', b'"caf\\u00e9"']),
    st.just(b"1" * 5000),
)
_VALID_IDS = VALID_KEYS.map(lambda key: json.dumps(key[0].decode()).encode())
_HOOKED = st.builds(
    lambda value, rest: b'{"id": ' + value + rest,
    st.one_of(_VALID_IDS, _VALID_IDS, _EVENT_IDS),
    st.sampled_from(
        [
            b"}",
            b"}",
            b"}",
            b"}",
            b', "id": "twice"}',
            b', "n": 1e400}',
            b"",
            b"}}",
            b', "x": ' + b"[" * 3000,
        ]
    ),
)
HOOKED_BODIES = st.one_of(_HOOKED, _HOOKED, _HOOKED, BODIES)


@EXAMPLES
@given(
    body=HOOKED_BODIES,
    content_type=st.one_of(_JSON_TYPE, CONTENT_TYPES),
    keys=st.one_of(st.just([]), KEYS),
)
def test_hostile_bodies_of_a_webhook_keyed_by_its_body(
    make_site: MakeSite, body: bytes, content_type: bytes, keys: list[bytes]
) -> None:
    """``key_from=json_field("id")``: whatever the body holds, the hook finds a key, none
    (a 400), or a malformed one (a 400), and never makes a 5xx; the Idempotency-Key header
    is then no key at all."""
    site = make_site(key_from=json_field("id"))
    site.key_from = lambda sent: _json_field_key(sent.body)
    check_exchange(site, Sent(keys, [(b"content-type", content_type)], body, b"", 1))


def _json_field_key(body: bytes) -> str | None:
    """What ``json_field("id")`` should find: the id, if a string or integer, and a valid key."""
    try:
        found = json.loads(body)
    except (ValueError, RecursionError):
        return None
    value = found.get("id") if isinstance(found, dict) else None
    if isinstance(value, bool) or not isinstance(value, str | int):
        return None
    try:
        return validate_key(str(value))
    except InvalidKeyError:
        return None


@pytest.mark.postgres
@settings(EXAMPLES, max_examples=max(15, EXAMPLES.max_examples // 4))
@given(sent=REQUESTS)
def test_hostile_requests_on_postgres(pg_site: Site, sent: Sent) -> None:
    check_exchange(pg_site, sent)


# --- defect #9: deeply nested JSON --------------------------------------------------------


def _deep_json(depth: int, spaced: bool) -> bytes:
    """``depth`` levels of objects and arrays in turn, around one float."""
    gap = b" " if spaced else b""
    opening = [b'{"a":' + gap if level % 2 == 0 else b"[" + gap for level in range(depth)]
    closing = [b"}" if level % 2 == 0 else gap + b"]" for level in reversed(range(depth))]
    return b"".join(opening) + b"1.0" + b"".join(closing)


def _json_request(body: bytes, key: bytes = b"deep-1") -> Sent:
    return Sent([key], [(b"content-type", b"application/json")], body, b"", 1)


def test_deeply_nested_json_is_fingerprinted_through_every_adapter(site: Site) -> None:
    """About 500 levels (a few KB, which json.loads accepts) run once; the same document
    spelt otherwise replays; another document is a 422, not a 500."""
    body = _deep_json(DEEP, spaced=False)
    assert json.loads(body)
    assert len(body) < 8 * 1024
    first = site.call(_json_request(body))
    assert first.status == 201, first
    again = site.call(_json_request(_deep_json(DEEP, spaced=True)))
    assert again.replayed
    assert again.body == first.body
    other = site.call(_json_request(_deep_json(DEEP - 1, spaced=False)))
    assert other.status == 422
    assert len(site.endpoint.reached) == 1


def test_json_deeper_than_the_parser_goes_is_fingerprinted_as_its_bytes(site: Site) -> None:
    """A body json.loads itself refuses for its depth is hashed as raw bytes, like any body
    that does not parse: it runs once and its byte-identical retry replays."""
    body = b"[" * 30_000 + b"]" * 30_000  # within the body limit, far past the parser
    first = site.call(_json_request(body, b"deeper"))
    assert first.status == 201, first
    assert site.call(_json_request(body, b"deeper")).replayed


FORM = (b"content-type", b"application/x-www-form-urlencoded")


def test_reordered_query_and_form_fields_are_one_request_through_every_adapter(
    site: Site,
) -> None:
    """Query parameters and form fields in another order are the same request (a replay);
    values of one name in another order are another request (a 422): ``tag=x&tag=y`` is a
    list. A query already in order keeps its fingerprint from before."""
    first = site.call(Sent([b"q-1"], [FORM], b"b=2&a=1&tag=x&tag=y", b"z=3&y=2", 1))
    assert first.status == 201, first
    again = site.call(Sent([b"q-1"], [FORM], b"tag=x&a=1&tag=y&b=2", b"y=2&z=3", 1))
    assert again.replayed, again
    assert again.body == first.body
    swapped = site.call(Sent([b"q-1"], [FORM], b"a=1&b=2&tag=y&tag=x", b"y=2&z=3", 1))
    assert swapped.status == 422, swapped
    other_query = site.call(Sent([b"q-1"], [FORM], b"a=1&b=2&tag=x&tag=y", b"y=2&z=4", 1))
    assert other_query.status == 422, other_query
    assert len(site.endpoint.reached) == 1


def test_the_key_header_is_an_option_on_every_adapter(make_site: MakeSite) -> None:
    """``key_header="X-GitHub-Delivery"``: a webhook's redelivery (same delivery id) replays,
    another delivery runs; ``Idempotency-Key`` alone is then no key (400 naming the header
    the app chose)."""
    site = make_site(key_header="X-GitHub-Delivery")
    json_type = (b"content-type", b"application/json")

    def delivery(value: bytes) -> Sent:
        return Sent([], [(b"x-github-delivery", value), json_type], b'{"event":"push"}', b"", 1)

    first = site.call(delivery(b"72d3162e-cc78-11e3-81ab-4c9367dc0958"))
    assert first.status == 201, first
    again = site.call(delivery(b"72d3162e-cc78-11e3-81ab-4c9367dc0958"))
    assert again.replayed
    assert again.body == first.body
    assert site.call(delivery(b"another-delivery")).status == 201
    keyed = site.call(Sent([b"k-1"], [json_type], b'{"event":"push"}', b"", 1))
    assert keyed.status == 400, keyed
    assert b"requires an X-GitHub-Delivery header" in keyed.body
    assert len(site.endpoint.reached) == 2
    # When the middleware is made: at once, or (Starlette's add_middleware) on the first call.
    with pytest.raises(ConfigurationError, match="key_header must be an HTTP header name"):
        make_site(key_header="X GitHub Delivery").call(delivery(b"d-2"))


def test_an_answer_the_endpoint_does_not_store_releases_the_key(site: Site) -> None:
    """``attempt.do_not_store()`` (a validation failure the app found itself): the 400 is
    sent, nothing is kept, and the client that fixes its body retries with the same key and
    gets the work done, not a 422 for a changed body."""
    json_type = (b"content-type", b"application/json")
    refused = site.call(Sent([b"fix-1"], [json_type], b"unkept: amount missing", b"", 1))
    assert refused.status == 400, refused
    assert not refused.replayed
    assert site.records() == []
    fixed = site.call(Sent([b"fix-1"], [json_type], b'{"amount": 5}', b"", 1))
    assert fixed.status == 201, fixed
    assert site.call(Sent([b"fix-1"], [json_type], b'{"amount": 5}', b"", 1)).replayed
    assert site.records() == [("fix-1", "completed")]
    assert len(site.endpoint.reached) == 2


def test_a_query_in_order_fingerprints_as_before() -> None:
    """Upgrading changes no stored fingerprint of a request whose pairs were already in
    order (most are: none, one, or written sorted): only reordered ones are new."""
    empty = hashlib.sha256(b"").hexdigest()
    before = f'{{"body":"{empty}","method":"POST","path":"/pay","query":"a=1&b=2","v":1}}'
    assert canonical_parts("POST", "/pay", b"a=1&b=2", [], b"") == before.encode()
    assert canonical_parts("POST", "/pay", b"b=2&a=1", [], b"") == before.encode()


def test_function_api_fingerprints_deep_payloads(tmp_path: Path) -> None:
    """The function API canonicalises any depth, on a real store; a payload that contains
    itself is InvalidPayloadError, never RecursionError."""
    store = SQLiteStore(str(tmp_path / "idempo.db"))
    store.migrate()
    guard = Idempotency(store)
    runs: list[int] = []
    for payload in (json.loads(_deep_json(DEEP, spaced=False)), json.loads(_deep_json(DEEP, True))):
        with guard.once("deep", operation="charge", payload=payload) as attempt:
            if not attempt.replayed:
                runs.append(1)
                attempt.result = {"ok": True}
    assert runs == [1]
    deeper: list[Any] = []
    tip = deeper
    for _ in range(50_000):
        tip.append([])
        tip = tip[0]
    with guard.once("deeper", operation="charge", payload=deeper) as attempt:
        attempt.result = "ran"
    cycle: list[Any] = []
    cycle.append(cycle)
    with pytest.raises(InvalidPayloadError), guard.once("cycle", operation="charge", payload=cycle):
        pytest.fail("a payload that contains itself must not run")
    assert store.stats().get("in_progress", 0) == 0
    store.close()


# --- a stored record that cannot be decoded -----------------------------------------------


def _corrupt(db: Path) -> None:
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE idempo_records SET response = X'00FF7B'")


@pytest.mark.parametrize("fail_open", [False, True])
def test_an_undecodable_record_is_a_503_that_says_how_to_evict(
    make_site: MakeSite, tmp_path: Path, fail_open: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """A record whose stored response cannot be read answers 503 corrupt-record with
    Retry-After, every time, without running the app (fail_open or not: the record may say
    the work already ran); the log names the evict command; once the record is gone, the
    request runs again."""
    site = make_site(fail_open=fail_open)
    sent = _json_request(b'{"plan": "pro"}', b"corrupt-1")
    assert site.call(sent).status == 201
    _corrupt(tmp_path / "idempo.db")
    with caplog.at_level(logging.ERROR, logger="idempo.http"):
        for _ in range(2):
            refused = site.call(sent)
            assert refused.status == 503, refused
            assert refused.headers[b"content-type"] == b"application/problem+json"
            assert refused.headers[b"retry-after"] == b"5"
            problem = json.loads(refused.body)
            assert problem["type"] == "urn:idempo:problem:corrupt-record"
            assert "evict" in problem["detail"]
    # Logged (idempo.store, ERROR) with the key as its digest, never raw.
    digest = key_digest("corrupt-1")
    assert "to evict it, idempo evict STORE-URL KEY --operation 'POST " in caplog.text
    assert f"the key whose digest is {digest}" in caplog.text
    assert "corrupt-1" not in caplog.text
    assert len(site.endpoint.reached) == 1
    assert site.records() == [("corrupt-1", "completed")]
    site.clear()  # what `idempo evict` does
    assert site.call(sent).status == 201
    assert len(site.endpoint.reached) == 2
