"""The Django middleware against SPEC §4's core rows, through Django's test client, with a
plain Django view and a Django REST framework APIView."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

import django_setup  # noqa: F401 - configures Django before its modules are imported

# isort: split
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.test import Client, override_settings
from django.urls import path
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from helpers import new_key
from idempo import ConfigurationError, Scope
from idempo.contrib.django import IdempotencyMiddleware
from idempo.stores.memory import MemoryStore

PAYMENT = {"amount": 1000, "currency": "EUR"}
GATE_SECONDS = 10

calls: Counter[str] = Counter()
started = threading.Event()
gate = threading.Event()


def payment(request: HttpRequest, pk: int) -> HttpResponse:
    calls["payment"] += 1
    response = JsonResponse({"payment": pk, "execution": calls["payment"]}, status=201)
    response.set_cookie("session", "secret-for-the-first-caller")
    return response


def status(request: HttpRequest, code: int) -> HttpResponse:
    calls[f"status-{code}"] += 1
    return JsonResponse({"execution": calls[f"status-{code}"]}, status=code)


def slow(request: HttpRequest) -> HttpResponse:
    calls["slow"] += 1
    started.set()
    assert gate.wait(GATE_SECONDS)
    return JsonResponse({"execution": calls["slow"]}, status=201)


def stream(request: HttpRequest, parts: int) -> StreamingHttpResponse:
    calls["stream"] += 1
    return StreamingHttpResponse(b"y" * 100 for _ in range(parts))


class Charges(APIView):
    """A DRF view: its Response renders inside the view, before the middleware sees it."""

    def post(self, request: Request, pk: int) -> Response:
        calls["drf"] += 1
        return Response({"charge": pk, "amount": request.data["amount"]}, status=201)


urlpatterns = [
    path("payments/<int:pk>", payment),
    path("status/<int:code>", status),
    path("slow", slow),
    path("stream/<int:parts>", stream),
    path("api/charges/<int:pk>", Charges.as_view()),
]


@pytest.fixture(autouse=True)
def urls() -> Iterator[None]:
    """This module's URLs (the settings are shared with other Django test modules)."""
    with override_settings(ROOT_URLCONF=__name__):
        yield


@pytest.fixture(params=["memory", "sqlite"])
def store(request: pytest.FixtureRequest) -> Any:
    """The store behind the middleware, fresh per test."""
    if request.param == "memory":
        return MemoryStore()
    return request.getfixturevalue("sqlite_store")


@pytest.fixture
def client(store: Any) -> Iterator[Client]:
    """A test client whose middleware uses ``store``; counters and gate reset."""
    calls.clear()
    started.clear()
    gate.clear()
    with override_settings(IDEMPO={"STORE": store}):
        yield Client()
    gate.set()


def post(client: Client, url: str, key: str | None, body: Any = None, **headers: str) -> Any:
    """POST JSON with an Idempotency-Key header when ``key`` is given."""
    if key is not None:
        headers["Idempotency-Key"] = key
    return client.post(url, body or {}, content_type="application/json", headers=headers)


def replayed(response: Any) -> bool:
    """Whether the middleware answered from the store."""
    return response.headers.get("Idempotent-Replayed") == "true"


def problem_of(response: Any, code: int, kind: str) -> dict[str, Any]:
    """The problem+json body, after checking its status and type."""
    assert response.status_code == code, response.content
    assert response["Content-Type"] == "application/problem+json"
    body: dict[str, Any] = response.json()
    assert body["type"] == f"urn:idempo:problem:{kind}"
    return body


def test_missing_key_is_400(client: Client) -> None:
    """A guarded request without a key is refused with 400 missing-key and never runs."""
    problem_of(post(client, "/payments/1", None, PAYMENT), 400, "missing-key")
    assert calls["payment"] == 0


def test_replay_is_byte_identical(client: Client) -> None:
    """A duplicate gets the first status, headers and body byte for byte, without the
    cookie, plus Idempotent-Replayed; the view runs once."""
    key = new_key()
    first = post(client, "/payments/7", key, PAYMENT)
    assert first.status_code == 201
    assert "session" in first.cookies
    second = post(client, "/payments/7", key, PAYMENT)
    assert replayed(second)
    assert second.status_code == 201
    assert second.content == first.content
    assert list(second.items()) == [*first.items(), ("idempotent-replayed", "true")]
    assert "session" not in second.cookies
    assert calls["payment"] == 1


def test_same_key_different_body_is_422(client: Client) -> None:
    """Reusing a key with another body is 422 fingerprint-mismatch; nothing runs again."""
    key = new_key()
    post(client, "/payments/1", key, PAYMENT)
    problem_of(post(client, "/payments/1", key, {"amount": 1}), 422, "fingerprint-mismatch")
    assert calls["payment"] == 1


def test_duplicate_while_running_is_409(store: Any, client: Client) -> None:
    """A duplicate of a request still running gets 409 with Retry-After, then the replay."""
    key = new_key()
    results: list[Any] = []
    thread = threading.Thread(target=lambda: results.append(post(Client(), "/slow", key)))
    with override_settings(IDEMPO={"STORE": store}):
        thread.start()
        assert started.wait(GATE_SECONDS)
        busy = post(client, "/slow", key)
        problem_of(busy, 409, "request-in-progress")
        assert int(busy["Retry-After"]) >= 1
        gate.set()
        thread.join(GATE_SECONDS)
    assert results[0].status_code == 201
    assert replayed(post(client, "/slow", key))
    assert calls["slow"] == 1


def test_route_template_scopes_the_key(store: Any, client: Client) -> None:
    """The URL pattern names the operation: /payments/1 and /payments/2 share one."""
    key = new_key()
    post(client, "/payments/1", key, PAYMENT)
    assert store.get(Scope.of(key, operation="POST payments/<int:pk>")) is not None
    problem_of(post(client, "/payments/2", key, PAYMENT), 422, "fingerprint-mismatch")


def test_4xx_is_replayed_and_5xx_released(client: Client) -> None:
    """A 404 is stored and replayed; a 500 releases the key so the retry runs again."""
    key = new_key()
    assert post(client, "/status/404", key).status_code == 404
    assert replayed(post(client, "/status/404", key))
    key = new_key()
    assert post(client, "/status/500", key).status_code == 500
    assert not replayed(post(client, "/status/500", key))
    assert (calls["status-404"], calls["status-500"]) == (1, 2)


def test_principals_are_isolated(client: Client) -> None:
    """Two Authorization headers with one key are two independent requests."""
    key = new_key()
    post(client, "/payments/1", key, PAYMENT, Authorization="A")
    assert not replayed(post(client, "/payments/1", key, PAYMENT, Authorization="B"))
    assert replayed(post(client, "/payments/1", key, PAYMENT, Authorization="A"))
    assert calls["payment"] == 2


def test_streaming_response_over_the_limit(store: Any) -> None:
    """A streaming response past the limit streams whole and is recorded as not stored."""
    calls.clear()
    with override_settings(IDEMPO={"STORE": store, "MAX_RESPONSE_BYTES": 250}):
        client = Client()
        key = new_key()
        first = post(client, "/stream/5", key)
        assert b"".join(first.streaming_content) == b"y" * 500
        problem_of(post(client, "/stream/5", key), 500, "response-not-stored")
        small = new_key()
        assert b"".join(post(client, "/stream/2", small).streaming_content) == b"y" * 200
        assert replayed(post(client, "/stream/2", small))
    assert calls["stream"] == 2


def test_drf_view_runs_once(store: Any, client: Client) -> None:
    """A DRF APIView behind the middleware: one execution, replayed byte for byte, scoped
    by its route."""
    key = new_key()
    first = post(client, "/api/charges/3", key, PAYMENT)
    second = post(client, "/api/charges/3", key, PAYMENT)
    assert first.status_code == 201
    assert first.json() == {"charge": 3, "amount": 1000}
    assert replayed(second)
    assert second.content == first.content
    assert calls["drf"] == 1
    assert store.get(Scope.of(key, operation="POST api/charges/<int:pk>")) is not None


def test_settings_are_checked() -> None:
    """Unknown IDEMPO settings and impossible ones raise ConfigurationError."""
    with (
        override_settings(IDEMPO={"STORE": "memory://", "STORAGE": 1}),
        pytest.raises(ConfigurationError),
    ):
        IdempotencyMiddleware(lambda request: HttpResponse())
    with override_settings(IDEMPO={}), pytest.raises(ConfigurationError):
        IdempotencyMiddleware(lambda request: HttpResponse())
    with override_settings(IDEMPO={"STORE": "memory://", "PRINCIPAL": "os.getcwd"}):
        assert IdempotencyMiddleware(lambda request: HttpResponse()).principal is not None


def test_an_unrouted_request_passes_through_unstored(client: Client) -> None:
    """SPEC §2 rule 7: a path no URL pattern matches is Django's own 404, answered before
    any view runs: passed through unguarded, nothing stored, so the key stays free."""
    key = new_key()
    first = post(client, "/nowhere", key, PAYMENT)
    again = post(client, "/nowhere", key, PAYMENT)
    assert first.status_code == again.status_code == 404
    assert not replayed(again)
    assert post(client, "/payments/1", key, PAYMENT).status_code == 201
