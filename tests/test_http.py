"""The framework-neutral HTTP pieces (idempo._http) and route-template discovery, without a
server: keys, principals, fingerprints, the stored format, classification and problems."""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime
from typing import Any

import pytest
from fastapi import APIRouter, FastAPI
from starlette.applications import Starlette
from starlette.routing import Mount, Route

from idempo import (
    ConfigurationError,
    CorruptRecordError,
    FingerprintMismatchError,
    IdempotencyError,
    InvalidKeyError,
    MissingKeyError,
    PrincipalRequiredError,
    Record,
    RequestInProgressError,
    RequestTooLargeError,
    Scope,
    Status,
    StoreUnavailableError,
)
from idempo._http import (
    NO_RESOLVER,
    HttpCodec,
    HttpRequest,
    HttpResponse,
    Principals,
    UnkeptResponse,
    canonical_request,
    classify_status,
    decode_response,
    default_principal,
    encode_response,
    parse_key,
    problem_for,
    request_fingerprint,
    user_principal,
)
from idempo.asgi import route_template
from idempo.events import key_digest

JSON = [(b"content-type", b"application/json")]


@pytest.mark.parametrize(
    ("values", "key"),
    [
        ([], None),
        ([b"abc"], "abc"),
        ([b'"abc"'], "abc"),
        ([b'  "abc"\t'], "abc"),
        ([b'"abc";p=1'], "abc"),
        ([b'"a\\"b"'], 'a"b'),
        ([b"x" * 255], "x" * 255),
        ([b":not-bytes:"], ":not-bytes:"),
    ],
)
def test_parse_key_accepts_tokens_and_sf_strings(values: list[bytes], key: str | None) -> None:
    """Bare tokens and sf-strings give the same key; parameters are ignored; absent is None."""
    assert parse_key(values) == key


@pytest.mark.parametrize(
    "values",
    [[b""], [b'""'], [b"x" * 256], [b"caf\xe9"], [b"a\x01b"], [b'"abc'], [b'"a" b'], [b"a", b"b"]],
)
def test_parse_key_refuses_malformed_values(values: list[bytes]) -> None:
    """Empty, too long, non-ASCII, control characters, bad sf-strings and repeated headers."""
    with pytest.raises(InvalidKeyError):
        parse_key(values)


def test_default_principal_hashes_the_credential() -> None:
    """The principal is the SHA-256 of the Authorization value, "" when there is none."""
    assert default_principal([]) == ""
    assert default_principal([b"Basic dTpw"]) == hashlib.sha256(b"Basic dTpw").hexdigest()
    assert default_principal([b"Bearer a"]) != default_principal([b"Bearer b"])


def _request(**changes: Any) -> HttpRequest:
    base: dict[str, Any] = {
        "method": "POST",
        "path": "/pay",
        "query": b"a=1",
        "headers": JSON,
        "body": b'{"x": [1, 2.0], "y": "z"}',
    }
    return HttpRequest(**{**base, **changes})


def test_fingerprint_covers_method_path_query_and_body() -> None:
    """Changing any counted part changes the fingerprint; equivalent JSON does not."""
    base = request_fingerprint(_request())
    assert request_fingerprint(_request(body=b'{"y":"z","x":[1,2]}')) == base
    for change in (
        {"method": "PATCH"},
        {"path": "/pay/2"},
        {"query": b"a=2"},
        {"body": b'{"x": [1, 3], "y": "z"}'},
    ):
        assert request_fingerprint(_request(**change)) != base, change


def test_fingerprint_of_non_json_bodies_is_raw() -> None:
    """A body that is not declared JSON, or JSON that does not parse, counts byte for byte."""
    text = [(b"content-type", b"text/plain")]
    assert request_fingerprint(_request(headers=text, body=b'{"a":1}')) != request_fingerprint(
        _request(headers=text, body=b'{ "a": 1 }')
    )
    broken = request_fingerprint(_request(body=b"{not json"))
    assert broken != request_fingerprint(_request(body=b"{not  json"))


def test_fingerprint_treats_json_media_types_alike() -> None:
    """``application/*+json`` with parameters is canonicalised like application/json."""
    problem_json = [(b"content-type", b"application/merge-patch+json; charset=utf-8")]
    assert request_fingerprint(
        _request(headers=problem_json, body=b'{"a":1,"b":2}')
    ) == request_fingerprint(_request(headers=problem_json, body=b'{"b":2, "a":1.0}'))


def test_fingerprint_fields_and_headers_are_configurable() -> None:
    """Only the named fields count; named headers count too, case-insensitively."""
    fields = ("method", "path")
    assert request_fingerprint(_request(), fields=fields) == request_fingerprint(
        _request(body=b"other", query=b""), fields=fields
    )
    tenant_a = [*JSON, (b"x-tenant", b"a")]
    tenant_b = [*JSON, (b"x-tenant", b"b")]
    assert request_fingerprint(_request(headers=tenant_a)) == request_fingerprint(
        _request(headers=tenant_b)
    )
    assert request_fingerprint(
        _request(headers=tenant_a), headers=["X-Tenant"]
    ) != request_fingerprint(_request(headers=tenant_b), headers=["X-Tenant"])


def test_canonical_request_is_rfc8785_json() -> None:
    """The canonical request is a JSON document with a version and one member per part."""
    document = json.loads(canonical_request(_request()))
    assert set(document) == {"v", "method", "path", "query", "body"}
    assert document["v"] == 1


def test_stored_format_round_trips_bytes_exactly() -> None:
    """Status, every header byte (Latin-1 included) in order and the body survive storage."""
    response = HttpResponse(
        201,
        ((b"x-latin", "caf\xe9".encode("latin-1")), (b"x-multi", b"1"), (b"x-multi", b"2")),
        b"\x00\nbinary\nbody\xff",
    )
    data = encode_response(response)
    assert data.startswith(b'{"v":1,')
    assert decode_response(data) == response


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"not json\nbody",
        b'{"v":2,"status":200,"headers":[]}\n',
        b'{"v":1,"status":"x","headers":[]}\n',
        b'{"v":1,"status":99,"headers":[]}\n',
        b'{"v":1,"status":200,"headers":[[1,2]]}\n',
        b'{"v":1,"status":200,"headers":[["\xe9","x"]]}\n',
        b'{"v":1,"status":200,"headers":' + b"[" * 5000 + b"]" * 5000 + b"}\n",
        b"\x00\xff\n",
        b"[]\n",
    ],
)
def test_unreadable_stored_responses_raise(data: bytes) -> None:
    """A record in an unknown format is CorruptRecordError, never a garbled replay nor
    another exception."""
    with pytest.raises(CorruptRecordError, match="cannot be read"):
        decode_response(data)


def test_codec_says_how_to_evict_an_unreadable_record() -> None:
    """The codec's error gives the evict command, with the operation, and the key by its
    digest only: neither the key nor the principal is spelled out."""
    now = datetime(2026, 1, 1, tzinfo=UTC)
    record = Record(
        Scope("user:7", "POST /pay", "k 1"), "fp", Status.COMPLETED, 1, None, b"junk", now, now, now
    )
    with pytest.raises(CorruptRecordError) as raised:
        HttpCodec().decode(record)
    message = str(raised.value)
    assert "idempo evict STORE-URL KEY --operation 'POST /pay' --principal PRINCIPAL" in message
    assert f"the key whose digest is {key_digest('k 1')}" in message
    assert "k 1" not in message
    assert "user:7" not in message


def test_shareable_drops_hop_by_hop_connection_named_and_cookies() -> None:
    """Hop-by-hop fields, fields named by Connection and Set-Cookie are not shared."""
    response = HttpResponse(
        200,
        (
            (b"Connection", b"close, X-Private"),
            (b"X-Private", b"1"),
            (b"Transfer-Encoding", b"chunked"),
            (b"Set-Cookie", b"s=1"),
            (b"ETag", b'"v1"'),
        ),
    )
    assert response.shareable().headers == ((b"ETag", b'"v1"'),)


def test_replay_marks_and_optionally_answers_200() -> None:
    """A replay adds Idempotent-Replayed once; status_200 changes only 2xx statuses."""
    created = HttpResponse(201, ((b"idempotent-replayed", b"stale"),), b"x")
    assert created.replay().headers == ((b"idempotent-replayed", b"true"),)
    assert created.replay(status_200=True).status == 200
    assert HttpResponse(404).replay(status_200=True).status == 404


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (200, Status.COMPLETED),
        (201, Status.COMPLETED),
        (303, Status.COMPLETED),
        (400, Status.FAILED),
        (404, Status.FAILED),
        (422, Status.FAILED),
        (408, None),
        (409, None),
        (425, None),
        (429, None),
        (500, None),
        (503, None),
        (101, None),
    ],
)
def test_classify_status_follows_the_spec(status: int, expected: Status | None) -> None:
    """SPEC §2 rule 7: success completes, deterministic 4xx fails, the rest is transient."""
    assert classify_status(status) is expected


def _record(response: bytes | None) -> Record:
    now = datetime(2026, 1, 1, tzinfo=UTC)
    return Record(Scope("", "op", "k"), "fp", Status.COMPLETED, 1, None, response, now, now, now)


def test_codec_stores_replays_and_releases() -> None:
    """The codec stores what the classifier keeps, releases the rest and on exceptions, and
    records an unkept response as a FAILED problem."""
    codec = HttpCodec()
    response = HttpResponse(201, ((b"set-cookie", b"s"), (b"x", b"1")), b"body")
    status, data = codec.encode_result(response)
    assert status is Status.COMPLETED
    assert codec.decode(_record(data)) == HttpResponse(201, ((b"x", b"1"),), b"body")
    assert codec.encode_result(HttpResponse(503)) == (None, b"")
    assert codec.encode_result(None) == (None, b"")
    assert codec.encode_error(RuntimeError()) == (None, b"")
    status, data = codec.encode_result(UnkeptResponse(201, 5000, 1000))
    assert status is Status.FAILED
    assert decode_response(data).status == 500
    assert codec.encode_result(UnkeptResponse(502, 5000, 1000)) == (None, b"")
    assert decode_response(codec.encode_unstorable(ValueError("x"))).status == 500
    with pytest.raises(CorruptRecordError):
        codec.decode(_record(None))


@pytest.mark.parametrize("status_200", [False, True])
@pytest.mark.parametrize(
    "data",
    [
        # Decoded without JSON (plain header bytes), and through JSON (an escaped quote, a
        # Latin-1 byte, an Idempotent-Replayed and a hop-by-hop field stored by a redactor).
        b'{"v":1,"status":201,"headers":[["x","1"]]}\nbody',
        b'{"v":1,"status":202,"headers":[["x","\\"\\u00e9"],["idempotent-replayed","no"],'
        b'["connection","close"]]}\nbody',
        b'{"v":1,"status":404,"headers":[]}\n',
    ],
)
def test_replaying_codec_decodes_the_replay_itself(data: bytes, status_200: bool) -> None:
    """The middlewares' codec (``replays=True``) decodes a record into what
    `HttpResponse.replay` makes of the stored response, without the stored one between."""
    codec = HttpCodec(replays=True, status_200=status_200)
    stored = HttpCodec().decode(_record(data))
    assert codec.decode(_record(data)) == stored.replay(status_200=status_200)


@pytest.mark.parametrize(
    ("error", "status", "kind", "retry_after"),
    [
        (MissingKeyError("no key"), 400, "missing-key", None),
        (InvalidKeyError("bad"), 400, "invalid-key", None),
        (RequestTooLargeError(10), 413, "request-too-large", None),
        (FingerprintMismatchError("k"), 422, "fingerprint-mismatch", None),
        (RequestInProgressError("k", 0.2), 409, "request-in-progress", b"1"),
        (RequestInProgressError("k", 2.1), 409, "request-in-progress", b"3"),
        (RequestInProgressError("k", 30.0), 409, "request-in-progress", b"5"),
        (StoreUnavailableError("down"), 503, "store-unavailable", b"5"),
        (CorruptRecordError("junk"), 503, "corrupt-record", b"5"),
        (PrincipalRequiredError("who?"), 401, "principal-required", None),
    ],
)
def test_problem_for_each_refusal(
    error: IdempotencyError, status: int, kind: str, retry_after: bytes | None
) -> None:
    """Each refusal is an RFC 9457 body with the right status, type and Retry-After."""
    response = problem_for(error)
    headers = dict(response.headers)
    body = json.loads(response.body)
    assert response.status == status
    assert headers[b"content-type"] == b"application/problem+json"
    assert int(headers[b"content-length"]) == len(response.body)
    assert set(body) == {"type", "title", "status", "detail"}
    assert body["type"] == f"urn:idempo:problem:{kind}"
    assert body["status"] == status
    assert headers.get(b"retry-after") == retry_after


# --- principals ---------------------------------------------------------------------------


class _User:
    def __init__(self, authenticated: bool = True, **ids: Any) -> None:
        self.is_authenticated = authenticated
        self.__dict__.update(ids)


@pytest.mark.parametrize(
    ("user", "principal"),
    [
        (None, None),
        (_User(authenticated=False, pk=1), None),
        (_User(pk=42), "user:42"),
        (_User(id="u-1", username="alice"), "user:u-1"),
        (_User(username="alice", email="a@x"), "user:alice"),
        ({"sub": "s-1"}, "user:s-1"),
        ("alice", "user:alice"),
        (7, "user:7"),
    ],
)
def test_user_principal_finds_the_users_own_id(user: Any, principal: str | None) -> None:
    """The framework's user becomes ``user:<its id>``; an anonymous user is no principal."""
    assert user_principal(user) == principal


def test_user_principal_refuses_an_authenticated_user_without_an_id() -> None:
    """Never a principal shared by every user of a class: a clear error naming principal=."""
    with pytest.raises(ConfigurationError, match="principal="):
        user_principal(_User(display_name="Alice"))


def test_principals_follow_spec_section_1() -> None:
    """Resolver first ("" anonymous, None refused unless allowed), then the framework's
    user, then Authorization, then anonymous."""
    rule = Principals(allow_anonymous=False, owner="test")
    nobody = lambda: None  # noqa: E731
    assert rule.resolve("tenant-1", nobody, [b"Bearer x"], False) == "tenant-1"
    assert rule.resolve("", nobody, [b"Bearer x"], False) == ""
    with pytest.raises(PrincipalRequiredError):
        rule.resolve(None, lambda: _User(pk=1), [b"Bearer x"], False)
    assert rule.resolve(NO_RESOLVER, lambda: _User(pk=1), [b"Bearer x"], True) == "user:1"
    hashed = rule.resolve(NO_RESOLVER, nobody, [b"Bearer x"], True)
    assert hashed == default_principal([b"Bearer x"])
    assert rule.resolve(NO_RESOLVER, nobody, [], True) == ""
    allowing = Principals(allow_anonymous=True, owner="test")
    assert allowing.resolve(None, lambda: _User(pk=2), [], False) == "user:2"
    assert allowing.resolve(None, nobody, [], True) == ""


# --- route templates ----------------------------------------------------------------------


async def _endpoint(request: Any) -> Any: ...


def _scope(method: str, path: str, root_path: str = "") -> dict[str, Any]:
    return {
        "type": "http",
        "method": method,
        "path": path,
        "root_path": root_path,
        "headers": [],
        "query_string": b"",
    }


def test_route_template_for_starlette_routes_and_mounts() -> None:
    """Starlette routes, nested mounts and method mismatches (405) all name their template;
    a mounted app without routes and an unknown path name none."""
    app = Starlette(
        routes=[
            Route("/payments/{id}", _endpoint, methods=["POST"]),
            Mount(
                "/v1",
                routes=[Mount("/shops/{shop}", routes=[Route("/orders/{n:int}", _endpoint)])],
            ),
            Mount("/opaque", app=_endpoint),
        ]
    )
    assert route_template(app, _scope("POST", "/payments/9")) == "/payments/{id}"
    assert route_template(app, _scope("PATCH", "/payments/9")) == "/payments/{id}"
    assert route_template(app, _scope("GET", "/v1/shops/a/orders/3")) == (
        "/v1/shops/{shop}/orders/{n:int}"
    )
    assert route_template(app, _scope("POST", "/opaque/x")) is None
    assert route_template(app, _scope("POST", "/nowhere")) is None
    assert route_template(object(), _scope("POST", "/payments/9")) is None


def test_route_template_for_fastapi_included_routers() -> None:
    """FastAPI routes, routers included with prefixes (nested too) name their full template."""
    app = FastAPI()
    outer = APIRouter(prefix="/api")
    inner = APIRouter(prefix="/v2")
    inner.add_api_route("/deep/{x}", _endpoint, methods=["PATCH"])
    outer.add_api_route("/things/{id}", _endpoint, methods=["POST"])
    outer.include_router(inner)
    app.include_router(outer)
    app.add_api_route("/payments/{id}", _endpoint, methods=["POST"])
    assert route_template(app, _scope("POST", "/payments/1")) == "/payments/{id}"
    assert route_template(app, _scope("POST", "/api/things/1")) == "/api/things/{id}"
    assert route_template(app, _scope("PATCH", "/api/v2/deep/1")) == "/api/v2/deep/{x}"
    assert route_template(app, _scope("POST", "/api/v2/deep/1")) == "/api/v2/deep/{x}"
    assert route_template(app, _scope("POST", "/api/none")) is None


def test_route_template_below_a_root_path() -> None:
    """Under a root path (a sub-app or a proxy prefix) routes match the path below it."""
    app = Starlette(routes=[Route("/payments/{id}", _endpoint, methods=["POST"])])
    scope = _scope("POST", "/prefix/payments/1", root_path="/prefix")
    assert route_template(app, scope) == "/payments/{id}"
