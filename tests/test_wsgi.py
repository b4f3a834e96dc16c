"""The WSGI middleware against SPEC §4's HTTP table, through Flask's test client on every
store, plus a real threaded WSGI server under concurrent duplicates."""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import httpx
import pytest
from flask import Flask, Response, jsonify, request
from psycopg_pool import ConnectionPool
from werkzeug.test import TestResponse

from helpers import new_key
from idempo import ConfigurationError, Idempotency, Policy, Scope, Status, StoreUnavailableError
from idempo.events import key_digest
from idempo.stores.memory import AsyncMemoryStore, MemoryStore
from idempo.stores.postgres import PostgresStore
from idempo.wsgi import IdempotencyWSGIMiddleware

PAYMENT = {"amount": 1000, "currency": "EUR"}
GATE_SECONDS = 10  # the most a gated handler waits for its test to open the gate


@dataclass
class Backend:
    """What ran, and a gate that holds the slow handler until the test opens it."""

    calls: Counter[str] = field(default_factory=Counter)
    started: threading.Event = field(default_factory=threading.Event)
    gate: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    slow_seconds: float = 0.0

    def count(self, name: str) -> int:
        with self.lock:
            self.calls[name] += 1
            return self.calls[name]


def build_app(backend: Backend, **options: Any) -> Flask:
    """A small Flask API behind the middleware."""
    app = Flask(__name__)

    @app.post("/payments/<int:pid>")
    def payment(pid: int) -> Response:
        n = backend.count("payment")
        response = jsonify(payment=pid, execution=n)
        response.status_code = 201
        response.set_cookie("session", "secret-for-the-first-caller")
        return response

    @app.patch("/payments/<int:pid>")
    def patch_payment(pid: int) -> Response:
        return jsonify(patched=pid, execution=backend.count("patch"))

    @app.post("/orders")
    def order() -> tuple[Response, int]:
        return jsonify(execution=backend.count("order"), body=request.get_data(as_text=True)), 201

    @app.post("/status/<int:code>")
    def status(code: int) -> tuple[Response, int]:
        return jsonify(execution=backend.count(f"status-{code}")), code

    @app.post("/slow")
    def slow() -> tuple[Response, int]:
        n = backend.count("slow")
        backend.started.set()
        if backend.slow_seconds:
            time.sleep(backend.slow_seconds)
        else:
            assert backend.gate.wait(GATE_SECONDS)
        return jsonify(execution=n), 201

    @app.post("/dies")
    def dies() -> Response:
        backend.count("dies")
        raise RuntimeError("the handler died")

    @app.post("/big/<int:size>")
    def big(size: int) -> tuple[bytes, int]:
        backend.count("big")
        return b"x" * size, 200

    @app.post("/stream/<int:parts>")
    def stream(parts: int) -> Response:
        backend.count("stream")
        return Response((b"y" * 100 for _ in range(parts)), status=200)

    @app.get("/items")
    def items() -> Response:
        return jsonify(execution=backend.count("items"))

    app.wsgi_app = IdempotencyWSGIMiddleware(app.wsgi_app, **options)  # type: ignore[method-assign]
    return app


LIGHT_STORES = ["memory", "sqlite"]


@pytest.fixture(params=LIGHT_STORES)
def light_store(request: pytest.FixtureRequest) -> Any:
    """The in-process stores, for rows that do not need every store."""
    if request.param == "memory":
        return MemoryStore()
    return request.getfixturevalue("sqlite_store")


@pytest.fixture
def backend() -> Iterator[Backend]:
    """A fresh backend; its gate opens at the end so no handler thread outlives the test."""
    backend = Backend()
    yield backend
    backend.gate.set()


def post(client: Any, path: str, key: str | None, **kwargs: Any) -> TestResponse:
    """POST with an Idempotency-Key header when ``key`` is given."""
    headers = dict(kwargs.pop("headers", {}))
    if key is not None:
        headers["Idempotency-Key"] = key
    return client.post(path, headers=headers, **kwargs)  # type: ignore[no-any-return]


def replayed(response: TestResponse) -> bool:
    """Whether the middleware answered from the store."""
    return response.headers.get("Idempotent-Replayed") == "true"


def problem_of(response: TestResponse, status: int, kind: str) -> dict[str, Any]:
    """The problem+json body, after checking its status and type."""
    assert response.status_code == status, response.get_data()
    assert response.headers["Content-Type"] == "application/problem+json"
    body: dict[str, Any] = response.get_json(force=True)
    assert body["type"] == f"urn:idempo:problem:{kind}"
    assert set(body) == {"type", "title", "status", "detail"}
    return body


def in_background(call: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """Run ``call`` in a thread; its result lands in the returned list."""
    results: list[Any] = []
    thread = threading.Thread(target=lambda: results.append(call()))
    thread.start()
    return thread, results


# --- core rows, on every store (PostgreSQL included) ------------------------------------


def test_first_request_and_duplicate_replay_byte_identical(store: Any, backend: Backend) -> None:
    """A duplicate gets the first response's status, headers and body byte for byte, minus
    Set-Cookie, plus Idempotent-Replayed, and the handler runs once."""
    client = build_app(backend, store=store).test_client()
    key = new_key()
    first = post(client, "/payments/7", key, json=PAYMENT)
    assert first.status_code == 201
    assert "session=" in first.headers["Set-Cookie"]
    assert not replayed(first)
    second = post(client, "/payments/7", key, json=PAYMENT)
    assert second.status_code == 201
    assert replayed(second)
    assert second.get_data() == first.get_data()
    expected = [(k, v) for k, v in first.headers.items() if k.lower() != "set-cookie"]
    assert list(second.headers.items()) == [*expected, ("idempotent-replayed", "true")]
    assert backend.calls["payment"] == 1


def test_missing_key_is_400(store: Any, backend: Backend) -> None:
    """A guarded request without a key is refused with 400 missing-key and never runs."""
    client = build_app(backend, store=store).test_client()
    problem_of(post(client, "/payments/1", None, json=PAYMENT), 400, "missing-key")
    assert backend.calls["payment"] == 0


def test_same_key_different_body_is_422(store: Any, backend: Backend) -> None:
    """Reusing a key with another body is 422 fingerprint-mismatch; nothing runs again."""
    client = build_app(backend, store=store).test_client()
    key = new_key()
    assert post(client, "/payments/1", key, json=PAYMENT).status_code == 201
    problem_of(post(client, "/payments/1", key, json={"amount": 1}), 422, "fingerprint-mismatch")
    assert backend.calls["payment"] == 1


def test_duplicate_while_running_is_409_with_retry_after(store: Any, backend: Backend) -> None:
    """A duplicate of a request still running gets 409 with Retry-After, then the replay."""
    app = build_app(backend, store=store)
    key = new_key()
    thread, results = in_background(lambda: post(app.test_client(), "/slow", key))
    assert backend.started.wait(GATE_SECONDS)
    busy = post(app.test_client(), "/slow", key)
    problem_of(busy, 409, "request-in-progress")
    assert 1 <= int(busy.headers["Retry-After"]) <= 5
    backend.gate.set()
    thread.join(GATE_SECONDS)
    assert results[0].status_code == 201
    again = post(app.test_client(), "/slow", key)
    assert replayed(again)
    assert again.get_data() == results[0].get_data()
    assert backend.calls["slow"] == 1


def test_deterministic_4xx_is_stored_and_5xx_released(store: Any, backend: Backend) -> None:
    """A 404 is an answer (stored and replayed); a 503 releases the key so a retry runs."""
    client = build_app(backend, store=store).test_client()
    key = new_key()
    assert post(client, "/status/404", key).status_code == 404
    assert replayed(post(client, "/status/404", key))
    assert backend.calls["status-404"] == 1
    key = new_key()
    assert post(client, "/status/503", key).status_code == 503
    retry = post(client, "/status/503", key)
    assert not replayed(retry)
    assert backend.calls["status-503"] == 2


def test_route_template_makes_one_operation(store: Any, backend: Backend) -> None:
    """Flask's rule, not the raw path, names the operation: /payments/1 and /payments/2
    share one (so the same key on both is a fingerprint mismatch, never a replay)."""
    client = build_app(backend, store=store).test_client()
    key = new_key()
    assert post(client, "/payments/1", key, json=PAYMENT).status_code == 201
    record = store.get(Scope.of(key, operation="POST /payments/<int:pid>"))
    assert record is not None
    assert record.status is Status.COMPLETED
    problem_of(post(client, "/payments/2", key, json=PAYMENT), 422, "fingerprint-mismatch")


def test_principals_are_isolated(store: Any, backend: Backend) -> None:
    """Two callers with different Authorization headers and one key get separate records."""
    client = build_app(backend, store=store).test_client()
    key = new_key()
    alice = post(client, "/payments/1", key, json=PAYMENT, headers={"Authorization": "A"})
    bob = post(client, "/payments/1", key, json=PAYMENT, headers={"Authorization": "B"})
    assert not replayed(alice)
    assert not replayed(bob)
    assert backend.calls["payment"] == 2
    principal = hashlib.sha256(b"A").hexdigest()
    scope = Scope.of(key, operation="POST /payments/<int:pid>", principal=principal)
    assert store.get(scope) is not None
    assert replayed(post(client, "/payments/1", key, json=PAYMENT, headers={"Authorization": "A"}))


# --- the other rows, on the in-process stores -------------------------------------------


def test_set_cookie_is_never_stored(light_store: Any, backend: Backend) -> None:
    """The first caller's cookie does not reach the store."""
    client = build_app(backend, store=light_store).test_client()
    key = new_key()
    post(client, "/payments/1", key, json=PAYMENT)
    record = light_store.get(Scope.of(key, operation="POST /payments/<int:pid>"))
    assert record is not None
    assert b"secret-for-the-first-caller" not in record.response


def test_replay_status_200_option(light_store: Any, backend: Backend) -> None:
    """With replay_status_200 a stored 201 is replayed as 200 with the same body."""
    client = build_app(backend, store=light_store, replay_status_200=True).test_client()
    key = new_key()
    first = post(client, "/payments/1", key, json=PAYMENT)
    second = post(client, "/payments/1", key, json=PAYMENT)
    assert (first.status_code, second.status_code) == (201, 200)
    assert second.get_data() == first.get_data()


def test_request_body_reaches_the_app_intact(light_store: Any, backend: Backend) -> None:
    """The app reads the same body the middleware fingerprinted."""
    client = build_app(backend, store=light_store).test_client()
    response = post(client, "/orders", new_key(), data=b"raw bytes \x00 here")
    assert response.get_json()["body"] == "raw bytes \x00 here"


def test_json_bodies_are_compared_canonically(light_store: Any, backend: Backend) -> None:
    """Key order and spacing in a JSON body do not make another request."""
    client = build_app(backend, store=light_store).test_client()
    key = new_key()
    json_type = {"Content-Type": "application/json"}
    post(client, "/orders", key, data=b'{"a": 1, "b": 2}', headers=json_type)
    again = post(client, "/orders", key, data=b'{"b":2,"a":1}', headers=json_type)
    assert replayed(again)
    assert backend.calls["order"] == 1


def test_same_key_different_query_is_422(light_store: Any, backend: Backend) -> None:
    """The query string is part of the fingerprint."""
    client = build_app(backend, store=light_store).test_client()
    key = new_key()
    post(client, "/orders?x=1", key)
    problem_of(post(client, "/orders?x=2", key), 422, "fingerprint-mismatch")


def test_fingerprint_headers_count_when_named(light_store: Any, backend: Backend) -> None:
    """A header named in fingerprint_headers makes another request when it changes."""
    app = build_app(backend, store=light_store, fingerprint_headers=("X-Tenant",))
    client = app.test_client()
    key = new_key()
    post(client, "/orders", key, headers={"X-Tenant": "a"})
    problem_of(post(client, "/orders", key, headers={"X-Tenant": "b"}), 422, "fingerprint-mismatch")


def test_exception_releases_the_key(light_store: Any, backend: Backend) -> None:
    """A handler that raises releases the key (Flask answers 500), so a retry runs again."""
    client = build_app(backend, store=light_store).test_client()
    key = new_key()
    assert post(client, "/dies", key).status_code == 500
    assert post(client, "/dies", key).status_code == 500
    assert backend.calls["dies"] == 2


def test_propagated_exception_releases_the_key(light_store: Any, backend: Backend) -> None:
    """An exception that escapes the app (Flask's testing mode) also releases the key."""
    app = build_app(backend, store=light_store)
    app.testing = True
    key = new_key()
    for _ in range(2):
        with pytest.raises(RuntimeError):
            post(app.test_client(), "/dies", key)
    assert backend.calls["dies"] == 2


@pytest.mark.parametrize("status", [200, 302, 400, 422, 408, 409, 425, 429, 500])
def test_status_classification(light_store: Any, backend: Backend, status: int) -> None:
    """2xx/3xx and deterministic 4xx replay; 408, 409, 425, 429 and 5xx release."""
    client = build_app(backend, store=light_store).test_client()
    key = new_key()
    post(client, f"/status/{status}", key)
    again = post(client, f"/status/{status}", key)
    stored = status < 500 and status not in (408, 409, 425, 429)
    assert replayed(again) is stored
    assert backend.calls[f"status-{status}"] == (1 if stored else 2)


@pytest.mark.parametrize("value", ['"abc', '"a" b', "has space", "", "x" * 256, "é"])
def test_malformed_keys_are_400(light_store: Any, backend: Backend, value: str) -> None:
    """Keys that are not 1-255 printable ASCII tokens or sf-strings are 400 invalid-key."""
    client = build_app(backend, store=light_store).test_client()
    headers = {"Idempotency-Key": value.encode("utf-8").decode("latin-1")}
    problem_of(post(client, "/orders", None, headers=headers), 400, "invalid-key")
    assert backend.calls["order"] == 0


def test_sf_string_and_bare_token_name_the_same_key(light_store: Any, backend: Backend) -> None:
    """``abc`` and ``"abc"`` are one key."""
    client = build_app(backend, store=light_store).test_client()
    key = new_key()
    post(client, "/orders", key)
    assert replayed(post(client, "/orders", f'"{key}"'))


def test_missing_key_passes_through_when_not_required(light_store: Any, backend: Backend) -> None:
    """With require_key=False a keyless request runs unguarded, every time."""
    client = build_app(backend, store=light_store, require_key=False).test_client()
    post(client, "/orders", None)
    post(client, "/orders", None)
    assert backend.calls["order"] == 2


def test_unguarded_methods_pass_through(light_store: Any, backend: Backend) -> None:
    """GET is not guarded by default: no key needed, runs every time."""
    client = build_app(backend, store=light_store).test_client()
    assert client.get("/items").status_code == 200
    assert client.get("/items", headers={"Idempotency-Key": '"bad'}).status_code == 200
    assert backend.calls["items"] == 2


def test_patch_is_another_operation(light_store: Any, backend: Backend) -> None:
    """The same key under PATCH and POST of one route are two operations."""
    client = build_app(backend, store=light_store).test_client()
    key = new_key()
    assert post(client, "/payments/1", key, json=PAYMENT).status_code == 201
    patched = client.patch("/payments/1", headers={"Idempotency-Key": key}, json=PAYMENT)
    assert patched.status_code == 200
    assert not replayed(patched)


def test_request_body_over_the_limit_is_413(light_store: Any, backend: Backend) -> None:
    """A body over max_request_bytes is 413 before anything is stored, declared or chunked."""
    client = build_app(backend, store=light_store, max_request_bytes=10).test_client()
    key = new_key()
    problem_of(post(client, "/orders", key, data=b"x" * 11), 413, "request-too-large")
    chunked = post(
        client,
        "/orders",
        key,
        input_stream=iter_stream(b"x" * 11),
        headers={"Transfer-Encoding": "chunked"},
    )
    problem_of(chunked, 413, "request-too-large")
    assert light_store.get(Scope.of(key, operation="POST /orders")) is None
    assert post(client, "/orders", key, data=b"x" * 10).status_code == 201


def iter_stream(data: bytes) -> io.BytesIO:
    """A request input stream without a length (Werkzeug then marks it terminated)."""
    return io.BytesIO(data)


def test_response_over_the_limit_is_sent_and_recorded_as_not_stored(
    light_store: Any, backend: Backend
) -> None:
    """An over-size response reaches its client whole; retries get response-not-stored and
    never run the handler again."""
    client = build_app(backend, store=light_store, max_response_bytes=100).test_client()
    key = new_key()
    first = post(client, "/big/101", key)
    assert first.get_data() == b"x" * 101
    retry = post(client, "/big/101", key)
    problem_of(retry, 500, "response-not-stored")
    assert replayed(retry)
    assert backend.calls["big"] == 1


def test_streamed_response_over_the_limit_streams_through(
    light_store: Any, backend: Backend
) -> None:
    """A generator response past the limit streams whole to its client, and is not kept."""
    client = build_app(backend, store=light_store, max_response_bytes=250).test_client()
    key = new_key()
    first = post(client, "/stream/5", key)
    assert first.get_data() == b"y" * 500
    problem_of(post(client, "/stream/5", key), 500, "response-not-stored")
    small = new_key()
    assert post(client, "/stream/2", small).get_data() == b"y" * 200
    assert replayed(post(client, "/stream/2", small))
    assert backend.calls["stream"] == 2


def test_principal_and_operation_resolvers(light_store: Any, backend: Backend) -> None:
    """principal= and operation= name the scope from the environ."""
    app = build_app(
        backend,
        store=light_store,
        principal=lambda environ: environ.get("HTTP_X_USER"),
        operation=lambda environ: "charge",
    )
    key = new_key()
    post(app.test_client(), "/payments/1", key, json=PAYMENT, headers={"X-User": "u1"})
    assert light_store.get(Scope.of(key, operation="charge", principal="u1")) is not None


def test_plain_wsgi_app_uses_the_raw_path(light_store: Any) -> None:
    """Without a Flask app to ask, the operation is METHOD plus the raw path."""

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]

    guarded = IdempotencyWSGIMiddleware(app, store=light_store)
    flask = Flask(__name__)
    flask.wsgi_app = guarded  # type: ignore[method-assign]
    key = new_key()
    assert post(flask.test_client(), "/a/b", key).get_data() == b"ok"
    assert light_store.get(Scope.of(key, operation="POST /a/b")) is not None


def test_background_renewal_keeps_a_slow_handler_alone(backend: Backend) -> None:
    """A handler slower than its lease is renewed, so a duplicate gets 409, not a takeover;
    renewal stops with the handler."""
    store = _CountingRenewals()
    app = build_app(backend, store=store, lease=0.3)
    backend.slow_seconds = 0.8
    key = new_key()
    thread, results = in_background(lambda: post(app.test_client(), "/slow", key))
    assert backend.started.wait(GATE_SECONDS)
    time.sleep(0.5)  # past the first lease
    problem_of(post(app.test_client(), "/slow", key), 409, "request-in-progress")
    thread.join(GATE_SECONDS)
    assert results[0].status_code == 201
    renewals = store.renewals
    assert renewals >= 2
    time.sleep(0.3)
    assert store.renewals == renewals
    assert backend.calls["slow"] == 1


class _CountingRenewals(MemoryStore):
    def __init__(self) -> None:
        super().__init__()
        self.renewals = 0

    def renew(self, *args: Any, **kwargs: Any) -> None:
        self.renewals += 1
        super().renew(*args, **kwargs)


class _FailingCompletion(MemoryStore):
    def complete(self, *args: Any, **kwargs: Any) -> None:
        raise StoreUnavailableError("the store went away mid-request")


def test_store_failing_after_the_work_still_answers(
    backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    """If recording fails, the client still gets its response and a warning names the key."""
    key = new_key()
    client = build_app(backend, store=_FailingCompletion()).test_client()
    response = post(client, "/payments/1", key, json=PAYMENT)
    assert response.status_code == 201
    # Named by its digest: raw keys stay out of log lines (idempo.events.key_digest).
    assert any(key_digest(key) in record.getMessage() for record in caplog.records)
    assert not any(key in record.getMessage() for record in caplog.records)


# --- an unreachable store ---------------------------------------------------------------


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def unreachable_store(monkeypatch: pytest.MonkeyPatch) -> Iterator[PostgresStore]:
    """A PostgreSQL store at a port where nothing listens, giving up after half a second."""
    monkeypatch.setattr(logging.getLogger("psycopg.pool"), "disabled", True)
    pool: ConnectionPool[Any] = ConnectionPool(
        f"postgresql://postgres@127.0.0.1:{_closed_port()}/test",
        kwargs={"autocommit": True},
        min_size=1,
        open=True,
        timeout=0.5,
    )
    try:
        yield PostgresStore(pool)
    finally:
        pool.close()


def test_unreachable_store_is_503(unreachable_store: PostgresStore, backend: Backend) -> None:
    """When the store cannot be reached the request is refused with 503 and Retry-After, and
    the handler does not run (fail closed)."""
    client = build_app(backend, store=unreachable_store, store_retry_after=7).test_client()
    response = post(client, "/payments/1", new_key(), json=PAYMENT)
    problem_of(response, 503, "store-unavailable")
    assert response.headers["Retry-After"] == "7"
    assert backend.calls["payment"] == 0


def test_unreachable_store_fails_open_when_asked(
    unreachable_store: PostgresStore, backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    """With fail_open the request runs without idempotency, body intact, with a warning."""
    client = build_app(backend, store=unreachable_store, fail_open=True).test_client()
    response = post(client, "/orders", new_key(), data=b"still here")
    assert response.status_code == 201
    assert response.get_json()["body"] == "still here"
    assert any("unguarded" in record.getMessage() for record in caplog.records)


# --- configuration ----------------------------------------------------------------------


def test_configuration_errors() -> None:
    """Impossible configurations raise ConfigurationError when the middleware is made."""

    def app(environ: Any, start_response: Any) -> list[bytes]:
        return []

    store = MemoryStore()
    bad: list[dict[str, Any]] = [
        {},
        {"store": store, "idempotency": Idempotency(store)},
        {"store": AsyncMemoryStore()},
        {"store": store, "max_request_bytes": -1},
        {"store": store, "max_retry_after": 0},
        {"store": store, "fingerprint_fields": ("cookies",)},
        {"idempotency": Idempotency(store), "lease": 3},
    ]
    for options in bad:
        with pytest.raises(ConfigurationError):
            IdempotencyWSGIMiddleware(app, **options)


def test_store_url_and_shared_guard(backend: Backend) -> None:
    """store= takes a URL; idempotency= shares a guard and its policy."""
    assert isinstance(
        IdempotencyWSGIMiddleware(lambda e, s: [], store="memory://").idempotency.store,
        MemoryStore,
    )
    shared = Idempotency(MemoryStore(), Policy())
    client = build_app(backend, idempotency=shared).test_client()
    key = new_key()
    post(client, "/orders", key)
    assert replayed(post(client, "/orders", key))


# --- a real server ----------------------------------------------------------------------


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextlib.contextmanager
def running_server(app: Any) -> Iterator[str]:
    """``app`` on a threaded wsgiref server on a free loopback port."""
    server = make_server(
        "127.0.0.1", 0, app, server_class=_ThreadingServer, handler_class=_QuietHandler
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.mark.slow
def test_concurrent_duplicates_on_a_real_server(store: Any, backend: Backend) -> None:
    """Twenty clients sending one key at once to a real server: exactly one execution; the
    others get 409 or the replay."""
    backend.slow_seconds = 0.3
    app = build_app(backend, store=store)
    key = new_key()
    barrier = threading.Barrier(20)
    statuses: list[tuple[int, bool]] = []

    def client(url: str) -> None:
        with httpx.Client(base_url=url, timeout=10) as http:
            barrier.wait()
            response = http.post("/slow", headers={"Idempotency-Key": key})
            statuses.append((response.status_code, "idempotent-replayed" in response.headers))

    with running_server(app) as url:
        threads = [threading.Thread(target=client, args=(url,)) for _ in range(20)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(GATE_SECONDS)
        with httpx.Client(base_url=url) as http:
            after = http.post("/slow", headers={"Idempotency-Key": key})
    assert backend.calls["slow"] == 1
    assert len(statuses) == 20
    assert {status for status, _ in statuses} <= {201, 409}
    assert sum(1 for status, again in statuses if status == 201 and not again) <= 1
    assert after.status_code == 201
    assert after.headers["idempotent-replayed"] == "true"


@pytest.mark.parametrize(("path", "status"), [("/nothing", 404), ("/items", 405)])
def test_an_unrouted_request_passes_through_unstored(
    light_store: Any, backend: Backend, path: str, status: int
) -> None:
    """SPEC §2 rule 7: Werkzeug's own 404 / 405 (no rule matches) is answered before any view
    runs: passed through unguarded, nothing stored, so the key stays free."""
    client = build_app(backend, store=light_store).test_client()
    key = new_key()
    first = post(client, path, key, json=PAYMENT)
    again = post(client, path, key, json=PAYMENT)
    assert first.status_code == again.status_code == status
    assert not replayed(again)
    meant = post(client, "/orders", key, json=PAYMENT)
    assert (meant.status_code, backend.calls["order"]) == (201, 1)
