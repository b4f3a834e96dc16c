"""Stored data protected at rest (issue 14 §3): a guard given a `KeyRing` seals every stored
outcome and recovery point, on every store and surface.

Shown by reading each store's raw rows and hashes with its own driver (no plaintext secret
there, and the replay through idempo byte-identical); rotation (old records replay while
their key stays in the ring, new ones use the new key, a removed key is a typed error); a
wrong key, tampered bytes, bytes moved to another scope or status, plaintext records and a
guard with no ring: each a typed `UndecryptableRecordError`, the work not run again, nothing
stored changed, and the HTTP answer the ``corrupt-record`` problem. Redaction is in
test_redaction.py.
"""

from __future__ import annotations

import json
import sqlite3
import sys
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pymysql
import pytest
import redis
from flask import Flask, jsonify
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.testclient import TestClient
from typer.testing import CliRunner

from helpers import Database, new_key
from idempo import (
    AsyncIdempotency,
    ConfigurationError,
    CorruptRecordError,
    Idempotency,
    Policy,
    Record,
    ReplayedFailureError,
    Scope,
    Status,
    UndecryptableRecordError,
    cli,
    open_store,
)
from idempo._core.progress import Progress
from idempo._http.codec import HttpCodec
from idempo.admin import Admin
from idempo.asgi import IdempotencyMiddleware
from idempo.consumer import Action, Consumer, Envelope, Reason
from idempo.encryption import (
    MAGIC,
    POINT_PREFIX,
    KeyRing,
    SealedCodec,
    generate_key,
    is_sealed,
    record_context,
    sealed_key_id,
)
from idempo.guard import FunctionCodec
from idempo.http import HttpResponse, HttpSettings
from idempo.serializers import JsonSerializer
from idempo.stores.cache import CachedStore
from idempo.stores.memory import AsyncMemoryStore, MemoryStore
from idempo.stores.mysql import connect_options
from idempo.testing import FakeClock
from idempo.wsgi import IdempotencyWSGIMiddleware

SECRET = "sk_live_9fQ2-distinctive-secret"
KEY_A, KEY_B = generate_key(), generate_key()
LEASE = timedelta(seconds=30)


def ring_a(**options: Any) -> KeyRing:
    return KeyRing({"2026-06": KEY_A}, **options)


def ring_ab() -> KeyRing:
    """Rotated: B seals, A still opens what it sealed."""
    return KeyRing({"2026-12": KEY_B, "2026-06": KEY_A}, current="2026-12")


def ring_b() -> KeyRing:
    """A retired: only B."""
    return KeyRing({"2026-12": KEY_B})


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(datetime(2026, 6, 1, tzinfo=UTC))


# --- raw reads: every store, through its own driver ---------------------------------------

KINDS = [
    pytest.param("memory", id="memory"),
    pytest.param("sqlite", id="sqlite"),
    pytest.param("pg", marks=pytest.mark.postgres, id="postgres"),
    pytest.param("mysql", marks=pytest.mark.mysql, id="mysql"),
    pytest.param("redis", marks=pytest.mark.redis, id="redis"),
]


def _redis_values(client: redis.Redis, key: bytes) -> list[bytes]:
    """Everything Redis holds under ``key``, whatever its type (a record is one string; the
    store's own index of records on a given clock is a sorted set)."""
    kind = client.type(key)
    if kind == b"string":
        return [client.get(key) or b""]
    if kind == b"hash":
        return [item for pair in client.hgetall(key).items() for item in pair]
    if kind == b"zset":
        return [member for member, _ in client.zrange(key, 0, -1, withscores=True)]
    raise AssertionError(f"{key!r} holds a {kind!r}, which this test cannot read")


def _flat(values: Any) -> bytes:
    """Every stored value as bytes, side by side."""
    out = []
    for value in values:
        if isinstance(value, bytes | bytearray | memoryview):
            out.append(bytes(value))
        elif isinstance(value, str):
            out.append(value.encode())
        else:
            out.append(repr(value).encode())
    return b"\x1f".join(out)


class AtRest:
    """A store and how to read everything it holds without idempo."""

    def __init__(self, store: Any, dump: Callable[[], bytes]) -> None:
        self.store = store
        self.dump = dump


@pytest.fixture(params=KINDS)
def at_rest(request: pytest.FixtureRequest) -> AtRest:
    kind = request.param
    if kind == "memory":
        memory = MemoryStore()

        def memory_dump() -> bytes:
            entries = memory._entries.values()
            return _flat(getattr(entry, name) for entry in entries for name in entry.__slots__)

        return AtRest(memory, memory_dump)
    store = request.getfixturevalue(f"{kind}_store")
    if kind == "redis":
        url, prefix = request.getfixturevalue("redis_url"), request.getfixturevalue("redis_prefix")

        def redis_dump() -> bytes:
            client = redis.Redis.from_url(url)
            try:
                keys = sorted(client.scan_iter(match=f"{prefix}:*"))
                assert keys, "the store holds nothing"
                return _flat(item for key in keys for item in _redis_values(client, key))
            finally:
                client.close()

        return AtRest(store, redis_dump)
    table = store.dialect.table
    sql = f"SELECT * FROM {table}"

    def sql_dump() -> bytes:
        if kind == "sqlite":
            conn = sqlite3.connect(store.path)
            try:
                rows = conn.execute(sql).fetchall()
            finally:
                conn.close()
        elif kind == "pg":
            with psycopg.connect(request.getfixturevalue("postgres_url")) as pg:
                rows = pg.execute(sql).fetchall()
        else:
            options = connect_options(request.getfixturevalue("mysql_url"))
            with pymysql.connect(**options) as my:
                cursor = my.cursor()
                cursor.execute(sql)
                rows = list(cursor.fetchall())
        assert rows, "the store holds nothing"
        return _flat(value for row in rows for value in row)

    return AtRest(store, sql_dump)


def _http_call(idem: Idempotency, key: str, body: bytes, executed: list[str]) -> HttpResponse:
    """One HTTP-shaped call through the guard (what every adapter does)."""
    with idem.once(key, operation="POST /keys", payload=b"{}", codec=HttpCodec()) as attempt:
        if not attempt.replayed:
            executed.append(key)
            attempt.result = HttpResponse(
                201, ((b"content-type", b"application/json"), (b"x-api-key", SECRET.encode())), body
            )
    result: HttpResponse = attempt.result
    return result


def _stepped_call(idem: Idempotency, key: str, executed: list[str]) -> Any:
    """A function call whose recovery point and result both carry the secret."""
    with idem.once(key, operation="mint", payload={"user": 7}) as attempt:
        if not attempt.replayed:
            executed.append(key)
            attempt.checkpoint("minted", {"token": SECRET})
            attempt.result = {"api_key": SECRET, "steps": list(attempt.steps)}
    return attempt.result


def test_no_store_keeps_a_plaintext_secret_and_replays_are_byte_identical(
    at_rest: AtRest,
) -> None:
    idem = Idempotency(at_rest.store, encryption=ring_a())
    executed: list[str] = []
    body = json.dumps({"id": "key_1", "api_key": SECRET}).encode() + b"\n\x00\xff binary tail"
    first = _http_call(idem, "http-1", body, executed)
    result = _stepped_call(idem, "fn-1", executed)

    raw = at_rest.dump()
    assert SECRET.encode() not in raw
    assert MAGIC + b"\x01\x072026-06" in raw  # the sealed header, with its key id
    assert POINT_PREFIX.encode() in raw  # the recovery point, sealed too

    replay = _http_call(idem, "http-1", body, executed)
    assert (replay.status, replay.headers, replay.body) == (first.status, first.headers, body)
    assert (
        _stepped_call(idem, "fn-1", executed) == result == {"api_key": SECRET, "steps": ["minted"]}
    )
    assert executed == ["http-1", "fn-1"]


def test_the_local_cache_keeps_the_sealed_bytes() -> None:
    """A `CachedStore` holds what its store returned: sealed, and replayed from memory."""
    store = CachedStore(MemoryStore())
    idem, executed = Idempotency(store, encryption=ring_a()), []
    body = json.dumps({"api_key": SECRET}).encode()
    first = _http_call(idem, "http-1", body, executed)
    replays = [_http_call(idem, "http-1", body, executed) for _ in range(2)]
    assert store.cache.hits >= 1
    cached = [store.cache._records[scope] for scope in store.cache.scopes()]
    assert cached
    assert all(is_sealed(record.response) for record in cached)
    assert SECRET.encode() not in _flat(record.response for record in cached)
    assert all(replay.body == first.body == body for replay in replays)
    assert executed == ["http-1"]


@pytest.mark.anyio
async def test_async_guards_seal_too(async_node_store: Any) -> None:
    idem = AsyncIdempotency(async_node_store, encryption=ring_a())
    calls = []

    @idem.idempotent(key="order_id")
    async def mint(order_id: str) -> dict[str, str]:
        calls.append(order_id)
        return {"api_key": SECRET}

    key = new_key()
    assert await mint(key) == await mint(key) == {"api_key": SECRET}
    record = await async_node_store.get(Scope.of(key, operation=_op(mint)))
    assert record is not None
    assert is_sealed(record.response)
    assert SECRET.encode() not in record.response
    assert calls == [key]


def _op(fn: Any) -> str:
    return f"{fn.__module__}.{fn.__qualname__}"


def test_the_apps_own_transaction_seals_too(postgres_database: Database) -> None:
    """Transactional mode on the app's psycopg connection: the record commits with the
    business row, sealed."""
    db = postgres_database
    db.create_business_table("order_id text")
    store = db.store()
    idem = Idempotency(store, encryption=ring_a())
    key = new_key()
    runs = 0

    def pay() -> Any:
        nonlocal runs
        with (
            db.connect(store) as conn,
            idem.once(key, operation="pay", payload={"order": 1}, conn=conn) as attempt,
        ):
            if not attempt.replayed:
                runs += 1
                conn.execute(f"INSERT INTO {db.business_table} VALUES ('o-1')")
                attempt.result = {"receipt": SECRET}
        return attempt.result

    try:
        assert pay() == pay() == {"receipt": SECRET}
    finally:
        store.close()
    rows = db.select(f"SELECT response, state FROM {db.records_table}")
    assert len(rows) == 1
    assert rows[0][1] == "completed"
    assert is_sealed(bytes(rows[0][0]))
    assert SECRET.encode() not in bytes(rows[0][0])
    assert db.select(f"SELECT count(*) FROM {db.business_table}") == [(1,)]
    assert runs == 1


# --- rotation, wrong keys, tampering: typed errors, nothing run, nothing changed ----------


def _charge(idem: Idempotency, key: str, runs: list[str]) -> Any:
    with idem.once(key, operation="charge", payload={"amount": 5}) as attempt:
        if not attempt.replayed:
            runs.append(key)
            attempt.result = {"charged": key, "card": SECRET}
    return attempt.result


def _stored(store: Any, key: str) -> Record:
    record = store.get(Scope.of(key, operation="charge"))
    assert record is not None
    return record


def _key_id(record: Record) -> str | None:
    return sealed_key_id(record.response)


def test_rotation_keeps_old_records_replayable_until_their_key_is_removed(
    node_store: Any,
) -> None:
    runs: list[str] = []
    old = _charge(Idempotency(node_store, encryption=ring_a()), "old", runs)

    rotated = Idempotency(node_store, encryption=ring_ab())
    assert _charge(rotated, "old", runs) == old  # sealed with A, opened with A
    new = _charge(rotated, "new", runs)
    assert (_key_id(_stored(node_store, "old")), _key_id(_stored(node_store, "new"))) == (
        "2026-06",
        "2026-12",
    )

    retired = Idempotency(node_store, encryption=ring_b())
    assert _charge(retired, "new", runs) == new
    before = _stored(node_store, "old")
    with pytest.raises(UndecryptableRecordError) as raised:
        _charge(retired, "old", runs)
    assert raised.value.key_id == "2026-06"
    assert isinstance(raised.value, CorruptRecordError)
    assert "'2026-06', which is not in the key ring" in str(raised.value)
    assert _stored(node_store, "old") == before
    assert runs == ["old", "new"]


def test_a_wrong_key_is_a_typed_error_and_nothing_runs_or_changes(node_store: Any) -> None:
    runs: list[str] = []
    _charge(Idempotency(node_store, encryption=ring_a()), "k-1", runs)
    before = _stored(node_store, "k-1")
    impostor = KeyRing({"2026-06": KEY_B})  # the same id, another key
    for _ in range(2):  # every retry, the same answer
        with pytest.raises(UndecryptableRecordError, match="does not authenticate"):
            _charge(Idempotency(node_store, encryption=impostor), "k-1", runs)
    assert _stored(node_store, "k-1") == before
    assert runs == ["k-1"]


def test_a_guard_without_a_ring_never_hands_sealed_bytes_on(node_store: Any) -> None:
    """Not to JSON, and not to a serializer that would replay them as they are."""

    class Raw:
        def dumps(self, value: Any) -> bytes:
            return bytes(value)

        def loads(self, data: bytes) -> Any:
            return data

    sealed = Idempotency(node_store, encryption=ring_a())
    with sealed.once("k-1", operation="charge", serializer=Raw()) as attempt:
        attempt.result = SECRET.encode()
    with (
        pytest.raises(UndecryptableRecordError, match="this guard has no key ring"),
        Idempotency(node_store).once("k-1", operation="charge", serializer=Raw()),
    ):
        pytest.fail("the work ran again")


def _rewrite(store: Any, key: str, like: Record, status: Status, response: bytes) -> None:
    """Store ``response`` as ``key``'s outcome (a request like ``like``'s) through the
    store's own verbs, as whoever can write to the store, but holds no key, can."""
    scope = Scope.of(key, operation="charge")
    store.evict(scope)
    ttl = timedelta(hours=1)
    found = store.reserve(scope, like.fingerprint, now=None, lease=LEASE, ttl=ttl)
    verb = store.complete if status is Status.COMPLETED else store.fail
    verb(scope, found.token, response, now=None, ttl=ttl)


def test_tampered_moved_or_relabelled_ciphertext_is_refused(node_store: Any) -> None:
    idem, runs = Idempotency(node_store, encryption=ring_a()), []
    _charge(idem, "victim", runs)
    victim = _stored(node_store, "victim")
    sealed = victim.response
    assert sealed is not None

    flipped = sealed[:-1] + bytes([sealed[-1] ^ 1])
    _rewrite(node_store, "victim", victim, Status.COMPLETED, flipped)
    with pytest.raises(UndecryptableRecordError, match="altered, or copied"):
        _charge(idem, "victim", runs)

    _rewrite(node_store, "victim", victim, Status.FAILED, sealed)  # COMPLETED relabelled
    with pytest.raises(UndecryptableRecordError):
        _charge(idem, "victim", runs)

    _rewrite(node_store, "thief", victim, Status.COMPLETED, sealed)  # moved to another scope
    with pytest.raises(UndecryptableRecordError):
        _charge(idem, "thief", runs)

    _rewrite(node_store, "victim", victim, Status.COMPLETED, sealed)  # put back: it opens
    assert _charge(idem, "victim", runs) == {"charged": "victim", "card": SECRET}
    assert runs == ["victim"]


def test_a_row_altered_in_place_with_sql_is_refused(sqlite_store: Any) -> None:
    idem, runs = Idempotency(sqlite_store, encryption=ring_a()), []
    _charge(idem, "k-1", runs)
    conn = sqlite3.connect(sqlite_store.path, isolation_level=None)
    try:
        (sealed,) = conn.execute("SELECT response FROM idempo_records").fetchone()
        altered = sealed[:30] + bytes([sealed[30] ^ 0x40]) + sealed[31:]  # in the ciphertext
        conn.execute("UPDATE idempo_records SET response = ?", (altered,))
    finally:
        conn.close()
    with pytest.raises(UndecryptableRecordError):
        _charge(idem, "k-1", runs)
    assert runs == ["k-1"]


def test_plaintext_records_are_refused_unless_the_ring_accepts_them(node_store: Any) -> None:
    """Records written before encryption was turned on: refused by default (whoever can
    write to the store could plant one), replayed with accept_plaintext for the changeover."""
    runs: list[str] = []
    plain = _charge(Idempotency(node_store), "before", runs)
    with pytest.raises(UndecryptableRecordError, match="stored in plaintext"):
        _charge(Idempotency(node_store, encryption=ring_a()), "before", runs)
    changeover = Idempotency(node_store, encryption=ring_a(accept_plaintext=True))
    assert _charge(changeover, "before", runs) == plain
    _charge(changeover, "after", runs)
    assert is_sealed(_stored(node_store, "after").response)  # new records are sealed
    assert runs == ["before", "after"]


# --- recovery points ---------------------------------------------------------------------


class Boom(Exception):
    """A transient failure after the first step."""


def _steps(idem: Idempotency, key: str, done: list[str], *, fail: bool = False) -> Any:
    with idem.once(key, operation="place-order", payload={"order": 7}) as attempt:
        if attempt.needs("charge"):
            done.append("charge")
            attempt.checkpoint("charge", {"charge_token": SECRET})
            if fail:
                raise Boom
        done.append("ship")
        attempt.result = dict(attempt.state)
    return attempt.result


def test_a_sealed_recovery_point_resumes_and_an_unopenable_one_never_reruns_steps(
    node_store: Any, clock: FakeClock
) -> None:
    policy = Policy(lease=LEASE, clock=clock)
    done: list[str] = []
    with pytest.raises(Boom):
        _steps(Idempotency(node_store, policy, encryption=ring_a()), "o-1", done, fail=True)
    scope = Scope.of("o-1", operation="place-order")
    kept = node_store.get(scope)
    assert kept.recovery_point.startswith(POINT_PREFIX)
    assert SECRET not in kept.recovery_point

    for guard in (
        Idempotency(node_store, policy, encryption=ring_b()),
        Idempotency(node_store, policy),
    ):
        with pytest.raises(UndecryptableRecordError, match="recovery point"):
            _steps(guard, "o-1", done)
        after = node_store.get(scope)
        assert after.recovery_point == kept.recovery_point  # the steps are still known
        assert after.lease_expires_at <= clock()  # and the key free for the next retry
    assert done == ["charge"]

    resumed = Idempotency(node_store, policy, encryption=ring_ab())
    assert _steps(resumed, "o-1", done) == {"charge_token": SECRET}
    assert done == ["charge", "ship"]  # resumed after the step: never charged twice


class CountsEveryErrorAsAFailure(FunctionCodec):
    """A surface codec that records every exception as FAILED (a consumer whose ``fail_on``
    is ``Exception``)."""

    def encode_error(self, exc: BaseException) -> tuple[Status | None, bytes]:
        return Status.FAILED, self.encode_unstorable(exc)


def test_an_unopenable_recovery_point_is_never_recorded_as_a_failure(
    node_store: Any, clock: FakeClock
) -> None:
    """Whatever the surface counts as a failure: the refusal is no outcome of the work."""
    policy = Policy(lease=LEASE, clock=clock)
    with pytest.raises(Boom):
        _steps(Idempotency(node_store, policy, encryption=ring_a()), "o-1", [], fail=True)
    scope = Scope.of("o-1", operation="place-order")
    kept = node_store.get(scope)
    strict = CountsEveryErrorAsAFailure(JsonSerializer(), ())
    for guard in (
        Idempotency(node_store, policy, encryption=ring_b()),
        Idempotency(node_store, policy),
    ):
        with (
            pytest.raises(UndecryptableRecordError),
            guard.once("o-1", operation="place-order", payload={"order": 7}, codec=strict),
        ):
            pytest.fail("the steps ran again")
        after = node_store.get(scope)
        assert (after.status, after.response) == (Status.IN_PROGRESS, None)
        assert after.recovery_point == kept.recovery_point


@pytest.mark.anyio
async def test_async_recovery_points_are_sealed(clock: FakeClock) -> None:
    store = AsyncMemoryStore()
    idem = AsyncIdempotency(store, Policy(lease=LEASE, clock=clock), encryption=ring_a())
    stale = await idem.begin("o-1", operation="ship")
    await stale.attempt.checkpoint("packed", {"label": SECRET})
    point = (await store.get(Scope.of("o-1", operation="ship"))).recovery_point
    assert point.startswith(POINT_PREFIX)
    assert SECRET not in point
    clock.advance(LEASE)
    async with idem.once("o-1", operation="ship") as attempt:
        assert (attempt.steps, dict(attempt.state)) == (("packed",), {"label": SECRET})
        attempt.result = "shipped"
    wrong = AsyncIdempotency(store, Policy(lease=LEASE, clock=clock), encryption=ring_b())
    with pytest.raises(UndecryptableRecordError):
        async with wrong.once("o-1", operation="ship"):
            pytest.fail("a replay it cannot open ran the work")


# --- HTTP: the corrupt-record problem, never a replay, never an execution ----------------


def _asgi(count: list[int], **options: Any) -> TestClient:
    async def mint(request: Request) -> Response:
        count.append(1)
        return JSONResponse({"api_key": SECRET, "n": len(count)}, status_code=201)

    app = IdempotencyMiddleware(
        Starlette(routes=[Route("/keys", mint, methods=["POST"])]), **options
    )
    return TestClient(app)


def _wsgi(count: list[int], **options: Any) -> Any:
    app = Flask(__name__)

    @app.post("/keys")
    def mint() -> Any:
        count.append(1)
        return jsonify(api_key=SECRET, n=len(count)), 201

    app.wsgi_app = IdempotencyWSGIMiddleware(app.wsgi_app, **options)  # type: ignore[method-assign]
    return app.test_client()


def _post(client: Any) -> Any:
    return client.post("/keys", headers={"Idempotency-Key": "key-1"}, json={"user": 7})


def _body(response: Any) -> bytes:
    return bytes(response.content if hasattr(response, "content") else response.data)


@pytest.mark.parametrize("face", ["asgi", "wsgi"])
def test_http_answers_corrupt_record_for_a_record_it_cannot_open(face: str) -> None:
    store: Any = AsyncMemoryStore() if face == "asgi" else MemoryStore()
    make = _asgi if face == "asgi" else _wsgi
    count: list[int] = []
    first = _post(make(count, store=store, encryption=ring_a()))
    assert first.status_code == 201
    assert SECRET.encode() in _body(first)
    records = getattr(store, "sync", store)
    stored = records.get(Scope.of("key-1", operation="POST /keys"))
    assert is_sealed(stored.response)
    assert SECRET.encode() not in stored.response

    # A retired key, the right id with the wrong key, no ring at all:
    for ring in (ring_b(), KeyRing({"2026-06": KEY_B}), None):
        answer = _post(make(count, store=store, encryption=ring))
        assert answer.status_code == 503
        assert answer.headers["content-type"] == "application/problem+json"
        problem = json.loads(_body(answer))
        assert problem["type"] == "urn:idempo:problem:corrupt-record"
        assert "key ring cannot open it" in problem["detail"]
        assert SECRET not in _body(answer).decode()
        assert records.get(Scope.of("key-1", operation="POST /keys")) == stored
    again = _post(make(count, store=store, encryption=ring_ab()))
    assert (again.status_code, again.headers["idempotent-replayed"]) == (201, "true")
    assert _body(again) == _body(first)
    assert count == [1]


def test_http_settings_take_a_ring_with_store_and_refuse_it_with_a_shared_guard() -> None:
    ring = ring_a()
    settings_ = HttpSettings({"store": MemoryStore(), "encryption": ring}, owner="Demo")
    assert settings_.idempotency.encryption is ring
    shared = Idempotency(MemoryStore(), encryption=ring)
    with pytest.raises(ConfigurationError, match="encryption go with store="):
        HttpSettings({"idempotency": shared, "encryption": ring}, owner="Demo")
    async_settings = HttpSettings(
        {"store": AsyncMemoryStore(), "encryption": ring}, owner="Demo", asynchronous=True
    )
    assert async_settings.idempotency.encryption is ring


# --- the ring itself ---------------------------------------------------------------------


def test_a_ring_refuses_what_cannot_work_and_never_shows_its_keys() -> None:
    with pytest.raises(ConfigurationError, match="at least one key"):
        KeyRing({})
    with pytest.raises(ConfigurationError, match="32 bytes"):
        KeyRing({"k": b"short"})
    with pytest.raises(ConfigurationError, match="32 bytes") as raised:
        KeyRing({"k": "not base64 at all!"})
    assert "not base64" not in str(raised.value)
    with pytest.raises(ConfigurationError, match="key id"):
        KeyRing({"has space": KEY_A})
    with pytest.raises(ConfigurationError, match="needs current="):
        KeyRing({"a": KEY_A, "b": KEY_B})
    with pytest.raises(ConfigurationError, match="not one of"):
        KeyRing({"a": KEY_A}, current="b")
    with pytest.raises(ConfigurationError, match="id:base64"):
        KeyRing.parse(KEY_A)
    with pytest.raises(ConfigurationError, match="given twice"):
        KeyRing.parse(f"a:{KEY_A},a:{KEY_B}")
    with pytest.raises(ConfigurationError, match="encryption= takes"):
        Idempotency(MemoryStore(), encryption=KEY_A)  # type: ignore[arg-type]
    ring = KeyRing.parse(f"new:{KEY_B}, old:{KEY_A.replace('+', '-').replace('/', '_')}")
    assert (ring.current, ring.key_ids) == ("new", ("new", "old"))
    assert KEY_A not in repr(ring)
    assert KEY_B not in repr(ring)
    assert KeyRing({"raw": bytes(32)}).current == "raw"


def test_a_ring_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigurationError, match="IDEMPO_ENCRYPTION_KEYS holds no"):
        KeyRing.from_env()
    monkeypatch.setenv("IDEMPO_ENCRYPTION_KEYS", f"2026-12:{KEY_B},2026-06:{KEY_A}")
    ring = KeyRing.from_env()
    assert ring.current == "2026-12"
    context = record_context(Scope("", "op", "k"), "completed")
    assert ring_ab().open(ring.seal(b"x", context), context) == b"x"


def test_without_cryptography_the_ring_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cryptography.hazmat.primitives.ciphers.aead", None)
    with pytest.raises(ConfigurationError, match=r"pip install 'idempo\[encryption\]'"):
        ring_a()


def test_unknown_formats_and_short_bytes_are_refused() -> None:
    ring, context = ring_a(), record_context(Scope("", "op", "k"), "completed")
    sealed = ring.seal(b"body", context)
    for broken in (MAGIC, MAGIC + b"\x02" + sealed[6:], sealed[:20], MAGIC + b"\x01\x02\xff\xfe"):
        with pytest.raises(UndecryptableRecordError):
            ring.open(broken, context)
    point = ring.seal_point("charged", Scope("", "op", "k"))
    with pytest.raises(UndecryptableRecordError, match="recovery point"):
        ring.open_point(point + "!", Scope("", "op", "k"))
    with pytest.raises(UndecryptableRecordError, match="recovery point"):
        ring.open_point(point, Scope("", "op", "other"))
    assert Progress.decode(
        ring_a(accept_plaintext=True).open_point("charged", Scope("", "o", "k"))
    ).steps == ("charged",)


headers = st.lists(
    st.tuples(
        st.binary(min_size=1, max_size=12).map(lambda b: b.replace(b"\n", b"x").lower()),
        st.binary(max_size=40),
    ).filter(lambda h: h[0] not in (b"set-cookie", b"connection", b"content-length")),
    max_size=4,
)


@settings(max_examples=50, deadline=None)
@given(
    status=st.integers(min_value=200, max_value=499).filter(
        lambda s: s not in (408, 409, 425, 429)
    ),
    headers=headers,
    body=st.binary(max_size=2048),
    principal=st.text(max_size=20),
)
def test_any_response_round_trips_sealed(
    status: int, headers: list[tuple[bytes, bytes]], body: bytes, principal: str
) -> None:
    scope = Scope(principal, "POST /x", "k-1")
    codec = SealedCodec(HttpCodec(), ring_ab(), scope)
    response = HttpResponse(status, tuple(headers), body).shareable()
    stored_status, stored = codec.encode_result(response)
    assert stored_status is not None
    assert is_sealed(stored)
    assert len(body) < 16 or body not in stored
    now = datetime(2026, 1, 1, tzinfo=UTC)
    record = Record(scope, "fp", stored_status, 1, None, stored, now, now, now)
    assert codec.decode(record) == response
    with pytest.raises(UndecryptableRecordError):
        SealedCodec(HttpCodec(), ring_ab(), Scope(principal + "x", "POST /x", "k-1")).decode(record)


def _containers(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20), _containers, max_leaves=12
)


@settings(max_examples=50, deadline=None)
@given(value=json_values)
def test_any_result_round_trips_through_a_sealed_guard(value: Any) -> None:
    idem = Idempotency(MemoryStore(), encryption=ring_a())
    for _ in range(2):
        with idem.once("k-1", operation="op") as attempt:
            if not attempt.replayed:
                attempt.result = value
        assert attempt.result == JsonSerializer().loads(JsonSerializer().dumps(value))
    assert attempt.replayed


# --- operators: an answer resolved by hand is sealed as the guard seals ------------------


def test_an_operators_resolution_is_sealed_for_a_guard_with_a_ring(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"sqlite:///{tmp_path}/ops.db"
    store = open_store(url)
    store.migrate()
    idem = Idempotency(store, encryption=ring_a())
    for key in ("plain", "sealed"):
        idem.begin(key, operation="charge", payload={"amount": 5})  # workers that died

    Admin(store).resolve(Scope.of("plain", operation="charge"), "ended by hand", force=True)
    with (
        pytest.raises(UndecryptableRecordError, match="plaintext"),
        idem.once("plain", operation="charge", payload={"amount": 5}),
    ):
        pytest.fail("ran")

    monkeypatch.setenv("APP_KEYS", f"2026-06:{KEY_A}")
    args = ["resolve", url, "sealed", "--operation", "charge", "--fail", "refunded by hand"]
    done = CliRunner().invoke(cli.app, [*args, "--force", "--encryption-env", "APP_KEYS"])
    assert done.exit_code == 0, done.output
    with (
        pytest.raises(ReplayedFailureError, match="refunded by hand"),
        idem.once("sealed", operation="charge", payload={"amount": 5}),
    ):
        pytest.fail("ran")
    refused = CliRunner().invoke(cli.app, [*args, "--encryption-env", "NO_SUCH_VARIABLE"])
    assert refused.exit_code == 2
    assert "NO_SUCH_VARIABLE holds no encryption keys" in refused.output
    store.close()


def test_inspect_shows_a_sealed_response_by_its_key_id(tmp_path: Any) -> None:
    url = f"sqlite:///{tmp_path}/ops.db"
    store = open_store(url)
    store.migrate()
    runs: list[str] = []
    _charge(Idempotency(store, encryption=ring_a()), "k-1", runs)
    store.close()
    runner = CliRunner()
    shown = runner.invoke(cli.app, ["inspect", url, "k-1", "--operation", "charge"])
    assert shown.exit_code == 0, shown.output
    assert "sealed with key '2026-06'" in shown.output
    data = json.loads(
        runner.invoke(cli.app, ["inspect", url, "k-1", "--operation", "charge", "--json"]).output
    )
    assert (data["status"], data["response_sealed_with"], data["response_text"]) == (
        "completed",
        "2026-06",
        None,
    )
    assert SECRET not in shown.output + json.dumps(data)


def test_a_consumer_seals_through_its_guard_and_requeues_what_it_cannot_open() -> None:
    """The consumer's codec is wrapped like any other: its results are sealed, and a
    redelivery the ring cannot open is requeued (store unavailable), never handled again."""
    store, handled = MemoryStore(), []

    def handler(delivery: Any) -> dict[str, str]:
        handled.append(delivery.key)
        return {"token": SECRET}

    def consumer(ring: KeyRing | None) -> Consumer:
        return Consumer(Idempotency(store, encryption=ring), name="mint", horizon=timedelta(0))

    message = Envelope("e-1", b'{"user": 7}')
    first = consumer(ring_a()).process(None, message, handler)
    record = store.get(Scope.of("e-1", operation="mint"))
    assert record is not None
    assert is_sealed(record.response)
    assert SECRET.encode() not in record.response
    again = consumer(ring_ab()).process(None, message, handler)
    assert (first.reason, again.reason, again.result) == (
        Reason.EXECUTED,
        Reason.DUPLICATE,
        {"token": SECRET},
    )
    for ring in (ring_b(), None):  # a retired key; no ring, whose codec hands bytes back
        refused = consumer(ring).process(None, message, handler)
        assert (refused.reason, refused.action) == (Reason.UNAVAILABLE, Action.REQUEUE)
        assert isinstance(refused.error, UndecryptableRecordError)
    assert handled == ["e-1"]
