"""The HTTP middlewares' ``redact=`` (issue 14 §3): the first caller gets the secret its
endpoint minted; the store keeps, and every replay gets, the redacted response. Through
Starlette (ASGI) and Flask (WSGI), with and without encryption, and the ready-made hooks.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable
from typing import Any

import pytest
from flask import Flask
from flask import Response as FlaskResponse
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.testclient import TestClient

from idempo import Scope
from idempo.asgi import IdempotencyMiddleware
from idempo.encryption import KeyRing, generate_key, is_sealed
from idempo.http import REDACTED, HttpResponse, redact_headers, redact_json
from idempo.stores.memory import AsyncMemoryStore, MemoryStore
from idempo.wsgi import IdempotencyWSGIMiddleware

SECRET = "whsec_Zq81-minted-once"
MINTED = json.dumps({"id": "key_1", "api_key": SECRET, "note": "shown once"}).encode()


def both(response: HttpResponse) -> HttpResponse:
    """The two ready-made hooks, one after the other."""
    return redact_json("api_key")(redact_headers("X-Api-Key")(response))


def _asgi(store: AsyncMemoryStore, runs: list[int], gzipped: bool, **options: Any) -> Any:
    async def mint(request: Request) -> Response:
        runs.append(1)
        headers = {"x-api-key": SECRET}
        body = MINTED
        if gzipped:
            body, headers["content-encoding"] = gzip.compress(MINTED), "gzip"
        return Response(body, 201, headers=headers, media_type="application/json")

    routes = [Route("/keys", mint, methods=["POST"])]
    return TestClient(IdempotencyMiddleware(Starlette(routes=routes), store=store, **options))


def _wsgi(store: MemoryStore, runs: list[int], gzipped: bool, **options: Any) -> Any:
    app = Flask(__name__)

    @app.post("/keys")
    def mint() -> FlaskResponse:
        runs.append(1)
        response = FlaskResponse(MINTED, 201, mimetype="application/json")
        response.headers["X-Api-Key"] = SECRET
        if gzipped:
            response.set_data(gzip.compress(MINTED))
            response.headers["Content-Encoding"] = "gzip"
        return response

    app.wsgi_app = IdempotencyWSGIMiddleware(app.wsgi_app, store=store, **options)  # type: ignore[method-assign]
    return app.test_client()


Face = Callable[..., Any]
FACES = [
    pytest.param((_asgi, AsyncMemoryStore), id="asgi"),
    pytest.param((_wsgi, MemoryStore), id="wsgi"),
]


def _send(client: Any) -> tuple[int, dict[str, str], bytes]:
    answer = client.post("/keys", headers={"Idempotency-Key": "mint-1"}, json={"user": 7})
    body = answer.content if hasattr(answer, "content") else answer.data
    return answer.status_code, {k.lower(): v for k, v in answer.headers.items()}, bytes(body)


def _kept(store: Any) -> bytes:
    record = getattr(store, "sync", store).get(Scope.of("mint-1", operation="POST /keys"))
    assert record is not None
    assert record.response is not None
    return bytes(record.response)


@pytest.mark.parametrize("face", FACES)
@pytest.mark.parametrize("sealed", [False, True], ids=["plain", "encrypted"])
def test_the_first_caller_gets_the_secret_and_replays_the_redacted_response(
    face: tuple[Face, type], sealed: bool
) -> None:
    make, store_class = face
    store, runs = store_class(), []
    options: dict[str, Any] = {"redact": both}
    if sealed:
        options["encryption"] = KeyRing({"2026-12": generate_key()})
    client = make(store, runs, False, **options)

    status, headers, body = _send(client)
    assert (status, body, headers["x-api-key"]) == (201, MINTED, SECRET)

    status, headers, body = _send(client)
    assert (status, headers["idempotent-replayed"]) == (201, "true")
    assert "x-api-key" not in headers
    assert json.loads(body) == {"id": "key_1", "api_key": REDACTED, "note": "shown once"}
    assert headers["content-length"] == str(len(body))  # set to the redacted body
    assert SECRET.encode() not in _kept(store)
    assert is_sealed(_kept(store)) is sealed
    assert _send(client)[2] == body  # every replay, the same redacted bytes
    assert runs == [1]


@pytest.mark.parametrize("face", FACES)
def test_a_body_it_cannot_look_into_is_never_stored(face: tuple[Face, type]) -> None:
    """A gzip body: the hook raises, the guard records response-not-stored, the first
    caller still gets its response and a retry does not run the endpoint again."""
    make, store_class = face
    store, runs = store_class(), []
    client = make(store, runs, True, redact=redact_json("api_key"))
    status, _, body = _send(client)
    # httpx (Starlette's test client) decompresses; Flask's hands the bytes over.
    assert (status, body if body == MINTED else gzip.decompress(body)) == (201, MINTED)
    status, _, body = _send(client)
    assert status == 500
    assert json.loads(body)["type"] == "urn:idempo:problem:response-not-stored"
    assert SECRET.encode() not in _kept(store)
    assert runs == [1]


def test_the_hooks_change_only_what_they_name() -> None:
    plain = HttpResponse(201, ((b"content-length", b"99"), (b"x-other", b"1")), b'{"id": 1}')
    assert redact_json("api_key")(plain) is plain  # no such field: the same bytes
    assert redact_headers("x-api-key")(plain) is plain
    for body in (b"", b"not json", b"[1, 2]", b'"text"', b"\xff\xfe"):
        response = HttpResponse(200, (), body)
        assert redact_json("api_key")(response) is response
    nested = HttpResponse(200, (), b'{"a": {"api_key": "s"}, "api_key": "t", "b": 2}')
    hidden = redact_json("api_key", "b", placeholder=None)(nested)
    assert json.loads(hidden.body) == {"a": {"api_key": "s"}, "api_key": None, "b": None}
    identity = HttpResponse(200, ((b"content-encoding", b"identity"),), b'{"api_key": "t"}')
    assert json.loads(redact_json("api_key")(identity).body) == {"api_key": REDACTED}
    with pytest.raises(ValueError, match="Content-Encoding"):
        redact_json("api_key")(HttpResponse(200, ((b"Content-Encoding", b"br"),), b"..."))
    kept = redact_headers("X-OTHER")(plain)
    assert kept.headers == ((b"content-length", b"99"),)
