"""The idempotent httpx client against a real server on loopback that drops, stalls and fails.

The server (uvicorn, h11) keeps its own idempotency records, like any idempo-guarded API: a
key in progress answers 409 with Retry-After, a completed one replays the first answer, the
same key with another body answers 422. Each test scripts, per intent and attempt, what goes
wrong; the server records the key every attempt carried, so "one key per intent, reused on
every retry" is asserted where it matters: on the server.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from email.utils import formatdate
from typing import Any

import httpx
import pytest
import uvicorn
from hypothesis import given, settings
from hypothesis import strategies as st

from idempo import ConfigurationError
from idempo.client import AsyncIdempotentTransport, IdempotentTransport, RetryPolicy
from idempo.client.retry import Answer, Error, Send, Wait, backoff, parse_retry_after, retry_flow

# --- the server ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Reply:
    """Answer this at once, executing nothing (a proxy's 503, a rate limit, a bad request)."""

    status: int
    retry_after: str | None = None


@dataclass(frozen=True)
class Slow:
    """Execute, and take this long to answer; meanwhile the key is in progress."""

    seconds: float


DROP = "drop"  # close the connection before executing: nothing happened
LOSE = "lose"  # execute, then close the connection without a byte of the answer
CUT = "cut"  # execute, then send the headers and half the body, and close

Action = Reply | Slow | str | None

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send_ = Callable[[dict[str, Any]], Awaitable[None]]


class Payments:
    """A payments endpoint with idempotency of its own and faults scripted per attempt."""

    def __init__(self) -> None:
        self.base_url = ""
        self.lock = threading.Lock()
        self.scripts: dict[str, list[Action]] = {}
        self.seen: dict[str, list[tuple[str | None, bytes]]] = defaultdict(list)
        self.executions: Counter[str] = Counter()
        self.first_answer: dict[str, bytes] = {}
        # key -> (request body, answer); None while the first attempt is still running
        self.records: dict[str, tuple[bytes, bytes] | None] = {}

    def intent(self, *actions: Action) -> str:
        """A fresh intent whose attempts meet ``actions`` in order, then a working server."""
        name = uuid.uuid4().hex
        with self.lock:
            self.scripts[name] = list(actions)
        return name

    def keys(self, intent: str) -> list[str | None]:
        with self.lock:
            return [key for key, _ in self.seen[intent]]

    def bodies(self, intent: str) -> list[bytes]:
        with self.lock:
            return [body for _, body in self.seen[intent]]

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send_) -> None:
        intent = scope["path"].rsplit("/", 1)[-1]
        key = dict(scope["headers"]).get(b"idempotency-key", b"").decode() or None
        body = await _read_body(receive)
        with self.lock:
            self.seen[intent].append((key, body))
            script = self.scripts.get(intent, [])
            action = script.pop(0) if script else None
        match action:
            case Reply(status, retry_after):
                return await _respond(send, status, b"{}", retry_after=retry_after)
            case "drop":
                return await _drop(send)
        if scope["method"] != "POST":
            return await _respond(send, 200, b"{}")
        if key is None:
            return await _respond(send, 400, b'{"title": "missing Idempotency-Key"}')
        with self.lock:
            record = self.records.get(key, ())
            if record == ():
                self.records[key] = None
                self.executions[intent] += 1
                execution = self.executions[intent]
        match record:
            case None:
                return await _respond(send, 409, b'{"title": "in progress"}', retry_after="1")
            case (first_body, _) if first_body != body:
                return await _respond(send, 422, b'{"title": "fingerprint mismatch"}')
            case (_, stored):
                answer, replayed = stored, True
            case _:
                # The first attempt of this key: the charge happens here, once.
                charge = {"intent": intent, "execution": execution, "charge": uuid.uuid4().hex}
                answer, replayed = json.dumps(charge).encode(), False
                if isinstance(action, Slow):
                    await asyncio.sleep(action.seconds)
                with self.lock:
                    self.records[key] = (body, answer)
                    self.first_answer.setdefault(intent, answer)
        match action:  # the answer, first or replayed, may still be lost on the way
            case "lose":
                return await _drop(send)
            case "cut":
                return await _cut(send, answer)
        return await _respond(send, 201, answer, replayed=replayed)


async def _read_body(receive: Receive) -> bytes:
    body = b""
    while True:
        message = await receive()
        body += bytes(message.get("body", b""))
        if not message.get("more_body"):
            return body


async def _respond(
    send: Send_, status: int, body: bytes, *, retry_after: str | None = None, replayed: bool = False
) -> None:
    headers = [(b"content-type", b"application/json")]
    if retry_after is not None:
        headers.append((b"retry-after", retry_after.encode()))
    if replayed:
        headers.append((b"idempotent-replayed", b"true"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _drop(send: Send_) -> None:
    # uvicorn marks a response started before it looks up the reason phrase; 600 has none, so
    # send() raises and uvicorn closes the connection without having written a byte.
    # test_the_server_really_drops_and_cuts checks that this still holds.
    await send({"type": "http.response.start", "status": 600, "headers": []})
    raise RuntimeError("the connection should have been dropped")


async def _cut(send: Send_, answer: bytes) -> None:
    headers = [(b"content-length", str(len(answer)).encode())]
    await send({"type": "http.response.start", "status": 201, "headers": headers})
    await send(
        {"type": "http.response.body", "body": answer[: len(answer) // 2], "more_body": True}
    )
    # An app that fails mid-answer makes uvicorn close the connection.
    raise RuntimeError("cut")


@pytest.fixture(scope="module")
def payments() -> Iterator[Payments]:
    """The payments server, on a free loopback port, for the whole module."""
    app = Payments()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(
        app,
        http="h11",
        ws="none",
        lifespan="off",
        log_config=None,
        log_level="critical",
        access_log=False,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    started = time.monotonic()
    while not server.started:
        assert time.monotonic() - started < 10, "uvicorn did not start"
        time.sleep(0.01)
    app.base_url = f"http://127.0.0.1:{sock.getsockname()[1]}/payments"
    yield app
    server.should_exit = True
    thread.join(10)
    sock.close()


# --- the client, sync and async ------------------------------------------------------------


class Sleeps:
    """An injected sleep that records what was asked and waits at most ``cap`` for real."""

    def __init__(self, cap: float = 0.0) -> None:
        self.cap = cap
        self.asked: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.asked.append(seconds)
        if self.cap:
            time.sleep(min(seconds, self.cap))


def fast(sleeps: Sleeps | None = None, **changes: Any) -> RetryPolicy:
    """A policy with tiny backoffs and a recording sleep."""
    changes.setdefault("sleep", sleeps or Sleeps())
    return RetryPolicy(backoff_base=0.01, backoff_max=0.05, **changes)


@dataclass
class Caller:
    """Sends requests through the sync or the async transport, one client per call."""

    base_url: str
    is_async: bool
    policy: RetryPolicy = field(default_factory=fast)

    def post(self, intent: str, **kwargs: Any) -> httpx.Response:
        return self.request("POST", intent, **kwargs)

    def request(
        self,
        method: str,
        intent: str,
        *,
        policy: RetryPolicy | None = None,
        timeout: float = 5.0,
        chunks: list[bytes] | None = None,
        **kwargs: Any,
    ) -> httpx.Response:
        return self.many(
            [intent], method=method, policy=policy, timeout=timeout, chunks=chunks, **kwargs
        )[0]

    def many(
        self,
        intents: list[str],
        *,
        method: str = "POST",
        policy: RetryPolicy | None = None,
        timeout: float = 5.0,
        chunks: list[bytes] | None = None,
        **kwargs: Any,
    ) -> list[httpx.Response]:
        """Send one request per intent, concurrently, through one client."""
        policy = policy or self.policy
        if chunks is None:
            kwargs.setdefault("json", {"amount": 100})
        if not self.is_async:
            transport = IdempotentTransport(policy=policy)
            with httpx.Client(transport=transport, timeout=timeout) as client:

                def one(intent: str) -> httpx.Response:
                    content: dict[str, Any] = {} if chunks is None else {"content": iter(chunks)}
                    return client.request(method, f"{self.base_url}/{intent}", **content, **kwargs)

                with ThreadPoolExecutor(max_workers=8) as pool:
                    return list(pool.map(one, intents))

        async def all_at_once() -> list[httpx.Response]:
            transport = AsyncIdempotentTransport(policy=policy)
            async with httpx.AsyncClient(transport=transport, timeout=timeout) as client:

                async def one(intent: str) -> httpx.Response:
                    content: dict[str, Any] = {} if chunks is None else {"content": _agen(chunks)}
                    return await client.request(
                        method, f"{self.base_url}/{intent}", **content, **kwargs
                    )

                return list(await asyncio.gather(*(one(intent) for intent in intents)))

        return asyncio.run(all_at_once())


async def _agen(chunks: list[bytes]) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk


@pytest.fixture(params=["sync", "async"])
def caller(request: pytest.FixtureRequest, payments: Payments) -> Caller:
    """The client in both faces: IdempotentTransport and AsyncIdempotentTransport."""
    return Caller(payments.base_url, is_async=request.param == "async")


def assert_once(payments: Payments, intent: str, response: httpx.Response) -> str:
    """The intent executed once, the caller got the first answer, every attempt one key."""
    keys = payments.keys(intent)
    key = response.extensions["idempotency_key"]
    assert keys == [key] * len(keys)
    assert response.extensions["idempotency_attempts"] == len(keys)
    assert payments.executions[intent] == 1
    assert response.status_code == 201
    assert response.content == payments.first_answer[intent]
    return str(key)


# --- the server-backed tests ---------------------------------------------------------------


def test_the_server_really_drops_and_cuts(payments: Payments) -> None:
    """Without idempo, the scripted faults reach the caller as broken connections."""
    for fault in (DROP, LOSE, CUT):
        intent = payments.intent(fault)
        with httpx.Client() as client, pytest.raises(httpx.RemoteProtocolError):
            client.post(f"{payments.base_url}/{intent}", headers={"Idempotency-Key": intent})


@pytest.mark.parametrize(
    "fault",
    [Reply(500), Reply(502), Reply(503), Reply(504), Reply(408), Reply(425), DROP, LOSE, CUT],
    ids=str,
)
def test_transient_faults_end_in_one_execution_and_the_first_answer(
    caller: Caller, payments: Payments, fault: Action
) -> None:
    """Two faults in a row are retried with the same key; one charge, the first answer."""
    intent = payments.intent(fault, fault)
    response = caller.post(intent)
    key = assert_once(payments, intent, response)
    assert response.extensions["idempotency_attempts"] == 3
    assert uuid.UUID(key).version == 4


def test_a_slow_first_attempt_is_waited_for_not_repeated(
    caller: Caller, payments: Payments
) -> None:
    """A timed-out attempt still running meets 409 + Retry-After, then the replayed answer."""
    intent = payments.intent(Slow(0.4))
    sleeps = Sleeps(cap=0.3)
    response = caller.post(intent, policy=fast(sleeps), timeout=0.15)
    assert_once(payments, intent, response)
    assert 1.0 in sleeps.asked  # the server's Retry-After: 1 on its 409
    assert response.headers["idempotent-replayed"] == "true"


def test_each_logical_request_gets_its_own_key(caller: Caller, payments: Payments) -> None:
    """Two calls are two intents: two fresh UUIDv4 keys, two executions."""
    intent = payments.intent(Reply(503))
    first, second = caller.post(intent), caller.post(intent)
    keys = payments.keys(intent)
    assert keys[0] == keys[1] != keys[2]
    assert [first.extensions["idempotency_key"], second.extensions["idempotency_key"]] == keys[1:]
    assert payments.executions[intent] == 2
    assert first.content != second.content


def test_a_key_the_caller_chose_is_kept(caller: Caller, payments: Payments) -> None:
    """An explicit Idempotency-Key is sent unchanged on every attempt and reported back."""
    intent = payments.intent(Reply(503), DROP)
    mine = f"order-{intent}"
    response = caller.post(intent, headers={"Idempotency-Key": mine})
    assert assert_once(payments, intent, response) == mine
    assert payments.keys(intent) == [mine] * 3


@pytest.mark.parametrize("status", [400, 422, 404, 401])
def test_client_errors_are_never_retried(caller: Caller, payments: Payments, status: int) -> None:
    """400, 422 and other 4xx are answered at once, even with a Retry-After."""
    intent = payments.intent(Reply(status, retry_after="0"))
    response = caller.post(intent)
    assert response.status_code == status
    assert response.extensions["idempotency_attempts"] == 1
    assert len(payments.keys(intent)) == 1


def test_a_fingerprint_mismatch_is_not_retried(caller: Caller, payments: Payments) -> None:
    """Reusing a key with another body gets the server's 422 once, and nothing executes."""
    intent = payments.intent()
    key = f"k-{intent}"
    assert caller.post(intent, headers={"Idempotency-Key": key}).status_code == 201
    other = caller.post(intent, headers={"Idempotency-Key": key}, json={"amount": 999})
    assert other.status_code == 422
    assert other.extensions["idempotency_attempts"] == 1
    assert payments.executions[intent] == 1
    assert len(payments.keys(intent)) == 2


def test_a_409_without_retry_after_is_a_conflict_not_a_wait(
    caller: Caller, payments: Payments
) -> None:
    """Only a 409 that says when to come back (idempo's "in progress") is retried."""
    intent = payments.intent(Reply(409))
    response = caller.post(intent)
    assert (response.status_code, response.extensions["idempotency_attempts"]) == (409, 1)


def test_retry_after_is_honoured_in_seconds_and_as_a_date(
    caller: Caller, payments: Payments
) -> None:
    """429, 503 and 409 waits follow the server's Retry-After, whether seconds or a date."""
    # Ten seconds ahead: the date and the answer's own Date both have 1 s granularity, and a
    # server's Date may lag a second or two on a busy machine, which a wait of three seconds
    # could not tell from a date misread.
    in_ten_seconds = formatdate(time.time() + 10, usegmt=True)
    intent = payments.intent(Reply(429, "2"), Reply(503, in_ten_seconds), Reply(409, "1"))
    clock = FakeMonotonic()
    policy = fast(clock=clock, sleep=clock.sleep)
    assert_once(payments, intent, caller.post(intent, policy=policy))
    two, ten, one = clock.slept
    assert (two, one) == (2.0, 1.0)
    assert 7.0 <= ten <= 13.0  # against the answer's own Date


def test_attempts_stop_at_the_maximum(caller: Caller, payments: Payments) -> None:
    """A server that keeps failing gets max_attempts attempts; the last answer is returned."""
    intent = payments.intent(*[Reply(503)] * 10)
    response = caller.post(intent, policy=fast(max_attempts=3))
    assert (response.status_code, response.extensions["idempotency_attempts"]) == (503, 3)
    keys = payments.keys(intent)
    assert len(keys) == 3
    assert len(set(keys)) == 1


def test_the_deadline_cuts_a_stalled_attempt(caller: Caller, payments: Payments) -> None:
    """An attempt's timeouts are cut to the deadline, and no retry starts after it."""
    intent = payments.intent(Slow(3.0))
    started = time.monotonic()
    with pytest.raises(httpx.ReadTimeout) as raised:
        caller.post(intent, policy=fast(deadline=0.3), timeout=10.0)
    # Cut at 0.3 s, not the server's 3 s or the 10 s asked: the rest is room for a busy machine.
    assert time.monotonic() - started < 2.0
    assert len(payments.keys(intent)) == 1
    key = payments.keys(intent)[0]
    assert any(f"Idempotency-Key: {key}" in note for note in raised.value.__notes__)


def test_the_deadline_stops_waits_in_real_time(caller: Caller, payments: Payments) -> None:
    """Retries run until the next wait would pass the deadline; the last answer stands."""
    intent = payments.intent(*[Reply(503, "0.25")] * 20)
    started = time.monotonic()
    response = caller.post(intent, policy=RetryPolicy(max_attempts=20, deadline=0.9))
    elapsed = time.monotonic() - started
    assert response.status_code == 503
    # Four at most (0, 0.25, 0.5, 0.75 s); fewer when a busy machine slows each attempt.
    assert 2 <= response.extensions["idempotency_attempts"] <= 4
    # It stops only when the next 0.25 s wait would pass 0.9 s, so never before 0.65 s; after
    # the deadline, only making the client (outside it) and a busy machine's lag.
    assert 0.65 <= elapsed < 2.0


def test_a_retry_after_past_the_deadline_is_not_waited_for(
    caller: Caller, payments: Payments
) -> None:
    """A Retry-After longer than the time left returns the answer instead of sleeping."""
    intent = payments.intent(Reply(503, "10"))
    sleeps = Sleeps()
    response = caller.post(intent, policy=fast(sleeps, deadline=5.0))
    assert (response.status_code, response.extensions["idempotency_attempts"]) == (503, 1)
    assert sleeps.asked == []


def test_get_is_neither_keyed_nor_retried(caller: Caller, payments: Payments) -> None:
    """Methods outside the policy pass through untouched: no key, one attempt."""
    intent = payments.intent(Reply(503))
    response = caller.request("GET", intent, json=None)
    assert response.status_code == 503
    assert "idempotency_key" not in response.extensions
    assert payments.keys(intent) == [None]


def test_a_streamed_body_is_sent_whole_on_every_attempt(caller: Caller, payments: Payments) -> None:
    """A generator body is read once, so every retry sends the same bytes."""
    intent = payments.intent(Reply(503), LOSE)
    response = caller.post(intent, chunks=[b'{"amount":', b" 5}"])
    assert_once(payments, intent, response)
    assert payments.bodies(intent) == [b'{"amount": 5}'] * 3


def test_a_streamed_body_over_the_limit_is_refused(caller: Caller, payments: Payments) -> None:
    """A streamed body larger than max_body_bytes raises before anything is sent."""
    intent = payments.intent()
    with pytest.raises(ConfigurationError, match="max_body_bytes"):
        caller.post(intent, chunks=[b"12345", b"678"], policy=fast(max_body_bytes=4))
    assert payments.keys(intent) == []


def test_many_concurrent_intents_each_execute_once(caller: Caller, payments: Payments) -> None:
    """Thirty concurrent intents, each hit by up to two faults, each charge exactly once."""
    faults: list[Action] = [None, Reply(503), Reply(429, "0"), DROP, LOSE, CUT, Slow(0.05)]
    intents = [
        payments.intent(faults[i % len(faults)], faults[(i * 3) % len(faults)]) for i in range(30)
    ]
    responses = caller.many(intents, policy=fast(Sleeps(cap=0.05)), timeout=2.0)
    keys = {assert_once(payments, intent, r) for intent, r in zip(intents, responses, strict=True)}
    assert len(keys) == len(intents)


# --- the transports on a mock ---------------------------------------------------------------


class FakeMonotonic:
    """A monotonic clock that moves only when slept on."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_errors_that_are_not_transient_are_raised_at_once() -> None:
    """An error outside retry_errors ends the call after one attempt, with the key noted."""
    attempts: list[httpx.Request] = []

    def broken(request: httpx.Request) -> httpx.Response:
        attempts.append(request)
        raise httpx.UnsupportedProtocol("gopher")

    transport = IdempotentTransport(httpx.MockTransport(broken), policy=fast())
    with httpx.Client(transport=transport) as client, pytest.raises(httpx.UnsupportedProtocol) as e:
        client.post("https://api.example/payments")
    assert len(attempts) == 1
    assert e.value.__notes__[0].startswith("idempo: 1 attempt(s) sent Idempotency-Key: ")


def test_retry_errors_name_what_is_transient() -> None:
    """A policy's retry_errors replace the default transient errors."""
    attempts: list[int] = []

    def flaky(request: httpx.Request) -> httpx.Response:
        attempts.append(1)
        if len(attempts) < 3:
            raise ValueError("flaky proxy")
        return httpx.Response(201)

    policy = fast(retry_errors=(ValueError,))
    transport = IdempotentTransport(httpx.MockTransport(flaky), policy=policy)
    with httpx.Client(transport=transport) as client:
        assert client.post("https://api.example/payments").status_code == 201
    assert len(attempts) == 3


def test_methods_are_configurable_and_case_insensitive() -> None:
    """A policy that guards PUT keys and retries it like a POST."""
    keys: list[str | None] = []

    def flaky(request: httpx.Request) -> httpx.Response:
        keys.append(request.headers.get("Idempotency-Key"))
        return httpx.Response(503 if len(keys) == 1 else 200)

    transport = IdempotentTransport(httpx.MockTransport(flaky), policy=fast(methods=["put"]))
    with httpx.Client(transport=transport) as client:
        assert client.put("https://api.example/orders/1").status_code == 200
        assert client.post("https://api.example/orders").status_code == 200
    assert keys[0] == keys[1] is not None
    assert keys[2] is None


def test_each_attempt_gets_only_the_time_left() -> None:
    """Every attempt's connect/read/write/pool timeouts are cut to what remains of the deadline."""
    clock = FakeMonotonic()
    timeouts: list[dict[str, float]] = []

    def busy(request: httpx.Request) -> httpx.Response:
        timeouts.append(request.extensions["timeout"])
        return httpx.Response(429, headers={"Retry-After": "4"})

    policy = fast(clock=clock, sleep=clock.sleep, deadline=10.0, max_attempts=2)
    transport = IdempotentTransport(httpx.MockTransport(busy), policy=policy)
    with httpx.Client(transport=transport, timeout=httpx.Timeout(30.0, connect=2.0)) as client:
        assert client.post("https://api.example/payments").status_code == 429
    assert timeouts == [
        {"connect": 2.0, "read": 10.0, "write": 10.0, "pool": 10.0},
        {"connect": 2.0, "read": 6.0, "write": 6.0, "pool": 6.0},
    ]


@pytest.mark.anyio
async def test_the_async_transport_awaits_an_async_sleep() -> None:
    """An injected sleep that returns an awaitable is awaited between attempts."""
    asked: list[float] = []
    answers = iter([httpx.Response(503, headers={"Retry-After": "0.5"}), httpx.Response(201)])

    async def sleep(seconds: float) -> None:
        asked.append(seconds)

    transport = AsyncIdempotentTransport(
        httpx.MockTransport(lambda request: next(answers)), policy=fast(sleep=sleep)
    )
    async with httpx.AsyncClient(transport=transport) as client:
        response = await client.post("https://api.example/payments")
    assert (response.status_code, response.extensions["idempotency_attempts"]) == (201, 2)
    assert asked == [0.5]


def test_importing_idempo_does_not_need_httpx() -> None:
    """httpx is an extra: the core package never imports it."""
    code = "import sys, idempo; sys.exit('httpx' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


# --- the rules, without I/O -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "date", "expected"),
    [
        ("120", None, 120.0),
        ("0", None, 0.0),
        ("1.5", None, 1.5),
        ("-1", None, None),
        ("nan", None, None),
        ("soon", None, None),
        (None, None, None),
        ("Wed, 21 Oct 2026 07:28:05 GMT", "Wed, 21 Oct 2026 07:28:00 GMT", 5.0),
        ("Wed, 21 Oct 2026 07:27:00 GMT", "Wed, 21 Oct 2026 07:28:00 GMT", 0.0),
        ("Wed, 21 Oct 2026 07:28:30 GMT", None, 30.0),  # against the wall clock below
    ],
)
def test_retry_after_values(value: str | None, date: str | None, expected: float | None) -> None:
    """Retry-After reads as seconds or an HTTP date; garbage and negatives are ignored."""
    now = datetime(2026, 10, 21, 7, 28, tzinfo=UTC)
    assert parse_retry_after(value, date=date, now=lambda: now) == expected


@settings(max_examples=200)
@given(st.integers(min_value=1, max_value=2000), st.floats(min_value=0, max_value=0.999999))
def test_backoff_is_full_jitter_under_a_growing_cap(retries: int, draw: float) -> None:
    """The wait is uniform in [0, min(max, base * 2**(n-1))), whatever n."""
    policy = RetryPolicy(backoff_base=0.1, backoff_max=5.0, random=lambda: draw)
    cap = min(5.0, 0.1 * 2.0 ** min(retries - 1, 64))
    assert backoff(policy, retries) == pytest.approx(draw * cap)


def test_the_flow_stops_when_a_wait_would_pass_the_deadline() -> None:
    """Backoffs run while they fit; the one that would cross the deadline ends the call."""
    clock = FakeMonotonic()
    policy = RetryPolicy(
        deadline=1.0, backoff_max=0.4, backoff_base=0.4, random=lambda: 0.999, clock=clock
    )
    flow = retry_flow(policy)
    steps: list[Send | Wait] = [next(flow)]
    try:
        while True:
            step = flow.send(Error(transient=True) if isinstance(steps[-1], Send) else None)
            if isinstance(step, Wait):
                clock.sleep(step.seconds)
            steps.append(step)
    except StopIteration as stop:
        attempts = stop.value
    assert attempts == 3
    assert [type(s).__name__ for s in steps] == ["Send", "Wait", "Send", "Wait", "Send"]
    second = steps[2]
    assert isinstance(second, Send)
    assert second.number == 2
    assert second.time_left == pytest.approx(1.0 - 0.3996)


def test_the_flow_returns_the_answer_it_will_not_retry() -> None:
    """A 201 ends the flow after one attempt."""
    flow = retry_flow(RetryPolicy())
    assert next(flow) == Send(1, 30.0)
    with pytest.raises(StopIteration) as stop:
        flow.send(Answer(201))
    assert stop.value.value == 1


@pytest.mark.parametrize(
    "changes",
    [
        {"retry_statuses": {400, 503}},
        {"retry_statuses": {422}},
        {"max_attempts": 0},
        {"deadline": 0},
        {"backoff_base": -1},
        {"max_body_bytes": -1},
    ],
)
def test_impossible_policies_are_refused(changes: dict[str, Any]) -> None:
    """Retrying 400/422, zero attempts or a non-positive deadline raise ConfigurationError."""
    with pytest.raises(ConfigurationError):
        RetryPolicy(**changes)


def test_a_long_retry_after_without_a_deadline_ends_the_retries() -> None:
    """Past max_retry_after the answer is returned rather than waited out."""
    policy = RetryPolicy(deadline=None, max_retry_after=60.0)
    flow = retry_flow(policy)
    next(flow)
    assert flow.send(Answer(503, retry_after=30.0)) == Wait(30.0)
    assert flow.send(None) == Send(2, None)
    with pytest.raises(StopIteration):
        flow.send(Answer(503, retry_after=3600.0))


def test_the_wall_clock_reads_a_date_without_a_date_header() -> None:
    """Without a Date header, an HTTP-date Retry-After is measured from the policy's clock."""
    now = datetime(2026, 1, 1, tzinfo=UTC)
    later = formatdate((now + timedelta(seconds=7)).timestamp(), usegmt=True)
    assert parse_retry_after(later, now=lambda: now) == 7.0
