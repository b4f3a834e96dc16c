"""Redis faults: a private redis-server killed mid-run, frozen, brought back; a holder
process SIGKILLed or frozen mid-work.

Each test runs its own redis-server on a free loopback port (tests/redis_servers.py), so it
can SIGKILL it, freeze it with SIGSTOP and start it again on the same port. The servers keep
an append-only file (``appendfsync always``, in the test's own directory) so that a restarted
server still holds every reservation it acknowledged: what the tests check is that no work
ever ran without one.

The bookkeeping is a `Ledger`: every call's outcome and every execution of the work, with the
fencing token it ran under. After the run every execution must match a record holding that
token (COMPLETED, or IN_PROGRESS when the store died before the completion could be stored —
the two-system gap), no key ran twice, and every replay gave the execution's result.

The crash tests at the end reuse tests/test_crashes.py's child-process harness with a Redis
child, on the machine's server and on the private cluster.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from helpers import new_key
from idempo import (
    AsyncIdempotency,
    Idempotency,
    Policy,
    RequestInProgressError,
    Scope,
    Status,
    StoreUnavailableError,
)
from idempo.asgi import IdempotencyMiddleware
from idempo.policy import utcnow
from idempo.stores.redis import AsyncRedisStore, RedisStore
from redis_servers import free_ports, redis_server, wait_for
from test_crashes import LEASE as CRASH_LEASE
from test_crashes import OPERATION as CRASH_OPERATION
from test_crashes import (
    Child,
    fenced_on_waking,
    take_over_after_expiry,
    taken_over_once_the_lease_ends,
)

pytestmark = [pytest.mark.redis, pytest.mark.slow]

OPERATION = "charge"
TIMEOUT = 0.5  # the stores' socket and connect timeouts, seconds
# Long enough that no lease ends during a test that does not mean it to: a second execution
# of a key would then be a bug, never a legitimate takeover.
POLICY = Policy(lease=timedelta(minutes=5))
CALLERS = 8
PHASE = 150  # calls per phase: before the kill, and after the restart


# -- servers -------------------------------------------------------------------------------


@contextmanager
def durable_server(port: int, directory: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A private redis-server whose append-only file survives SIGKILL: a restart on the same
    port and directory gets back every write the server acknowledged."""
    with redis_server(
        port, "--appendonly", "yes", "--appendfsync", "always", "--dir", str(directory)
    ) as server:
        yield server


def kill(server: subprocess.Popen[bytes]) -> None:
    server.kill()
    server.wait()


@pytest.fixture
def port() -> int:
    """A free loopback port for the test's own server."""
    (free,) = free_ports(1)
    return free


def url_of(port: int) -> str:
    return f"redis://127.0.0.1:{port}/0"


def prefix() -> str:
    return f"fault-{uuid.uuid4().hex[:8]}"


# -- the ledger ----------------------------------------------------------------------------


@dataclass
class Ledger:
    """Every call's outcome and every execution of the work, from any number of threads or
    tasks."""

    outcomes: Counter[str] = field(default_factory=Counter)
    executions: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: defaultdict(list))
    answers: dict[str, list[Any]] = field(default_factory=lambda: defaultdict(list))
    gaps: set[str] = field(default_factory=set)  # ran, but the completion was not stored
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, kind: str) -> int:
        with self.lock:
            return self.outcomes[kind]

    @contextmanager
    def call(self, key: str) -> Iterator[Callable[[Any], None]]:
        """Around one guarded call: gives the block's body, which replays or runs the work
        (noting the execution and its token), and files the call's outcome."""
        ran: list[dict[str, Any]] = []

        def body(attempt: Any) -> None:
            if attempt.replayed:
                with self.lock:
                    self.outcomes["replayed"] += 1
                    self.answers[key].append(attempt.result)
                return
            result = {"nonce": uuid.uuid4().hex, "token": attempt.token}
            with self.lock:
                self.executions[key].append(result)
            ran.append(result)
            attempt.result = result

        try:
            yield body
        except StoreUnavailableError:
            with self.lock:
                self.outcomes["unavailable"] += 1
                if ran:
                    self.gaps.add(key)
        except RequestInProgressError:
            with self.lock:
                self.outcomes["in_progress"] += 1
        except Exception as exc:  # anything else is what the test is looking for
            with self.lock:
                self.errors.append(f"{key}: {exc!r}")
        else:
            if ran:
                with self.lock:
                    self.outcomes["executed"] += 1
                    self.answers[key].append(ran[0])

    def check(self, records: dict[str, Any]) -> None:
        """Against the records a live server holds now: every execution ran under a
        reservation the server kept, no key ran twice, every answer was the execution's."""
        assert self.errors == [], self.errors[:5]
        for key, runs in self.executions.items():
            assert len(runs) == 1, (key, runs)
            record = records[key]
            assert record is not None, f"{key} ran with no reservation on record"
            assert record.token == runs[0]["token"], (key, record, runs)
            if key in self.gaps:
                # The completion may have been applied with only its reply lost.
                assert record.status in (Status.IN_PROGRESS, Status.COMPLETED), record
            else:
                assert record.status == Status.COMPLETED, record
        for key, answers in self.answers.items():
            assert answers == [self.executions[key][0]] * len(answers), (key, answers)


def scope_of(key: str) -> Scope:
    return Scope.of(key, operation=OPERATION)


def crowd(ledger: Ledger, call: Callable[[str], None], stop: threading.Event) -> list[Any]:
    """CALLERS threads walking the same keys in step (so duplicates meet), until ``stop``."""
    run = uuid.uuid4().hex[:6]

    def walk() -> None:
        n = 0
        while not stop.is_set():
            call(f"{run}-{n}")
            n += 1

    threads = [threading.Thread(target=walk) for _ in range(CALLERS)]
    for thread in threads:
        thread.start()
    return threads


# -- killed mid-run ------------------------------------------------------------------------


def test_server_killed_under_load_runs_nothing_unreserved_and_resumes(
    port: int, tmp_path: Path
) -> None:
    """8 threads call a guarded function on shared keys while the server is SIGKILLed and
    then restarted on the same port: each call completed under a reservation, replayed, was
    told the key is in progress, or raised StoreUnavailableError; every execution matches a
    record with its token, none ran twice, and calls execute again once the server is back."""
    ledger = Ledger()
    store = RedisStore(
        url_of(port), prefix=prefix(), socket_timeout=TIMEOUT, socket_connect_timeout=TIMEOUT
    )
    idem = Idempotency(store, POLICY)

    def call(key: str) -> None:
        with ledger.call(key) as body, idem.once(key, operation=OPERATION, payload=key) as a:
            body(a)

    stop = threading.Event()
    try:
        with durable_server(port, tmp_path) as server:
            threads = crowd(ledger, call, stop)
            wait_for(lambda: ledger.count("executed") >= PHASE, "calls before the kill")
            kill(server)
        wait_for(lambda: ledger.count("unavailable") >= 4 * CALLERS, "calls to fail closed")
        executed_while_down = ledger.count("executed")
        with durable_server(port, tmp_path):
            wait_for(
                lambda: ledger.count("executed") >= executed_while_down + PHASE,
                "calls after the restart",
            )
            stop.set()
            for thread in threads:
                thread.join()
            # No execution slipped in while the server was down: every one is on record.
            ledger.check({key: store.get(scope_of(key)) for key in ledger.executions})
            # Keys that ran before the kill replay from the restarted server, unrun.
            before = list(ledger.executions)[:20]
            for key in before:
                call(key)
            ledger.check({key: store.get(scope_of(key)) for key in ledger.executions})
    finally:
        stop.set()
        store.close()
    assert ledger.count("unavailable") >= 4 * CALLERS


@pytest.mark.anyio
async def test_async_server_killed_under_load_runs_nothing_unreserved_and_resumes(
    port: int, tmp_path: Path
) -> None:
    """The same with 8 asyncio tasks on one AsyncRedisStore: through the kill and the
    restart, every execution matches a record with its token and none ran twice."""
    ledger = Ledger()
    store = AsyncRedisStore(
        url_of(port), prefix=prefix(), socket_timeout=TIMEOUT, socket_connect_timeout=TIMEOUT
    )
    idem = AsyncIdempotency(store, POLICY)
    run = uuid.uuid4().hex[:6]
    stop = anyio.Event()

    async def call(key: str) -> None:
        with ledger.call(key) as body:
            async with idem.once(key, operation=OPERATION, payload=key) as a:
                body(a)

    async def walk() -> None:
        n = 0
        while not stop.is_set():
            await call(f"{run}-{n}")
            n += 1

    async def records() -> dict[str, Any]:
        return {key: await store.get(scope_of(key)) for key in ledger.executions}

    try:
        with ExitStack() as restarted:
            async with anyio.create_task_group() as group:
                with durable_server(port, tmp_path) as server:
                    for _ in range(CALLERS):
                        group.start_soon(walk)
                    await poll(lambda: ledger.count("executed") >= PHASE, "calls before the kill")
                    kill(server)
                await poll(lambda: ledger.count("unavailable") >= 4 * CALLERS, "calls to fail")
                executed_while_down = ledger.count("executed")
                restarted.enter_context(durable_server(port, tmp_path))
                await poll(
                    lambda: ledger.count("executed") >= executed_while_down + PHASE,
                    "calls after the restart",
                )
                stop.set()
            ledger.check(await records())
            for key in list(ledger.executions)[:20]:
                await call(key)
            ledger.check(await records())
    finally:
        await store.aclose()


async def poll(condition: Callable[[], bool], what: str) -> None:
    """`wait_for` for async tests, in a worker thread so the tasks it waits on run on."""
    await anyio.to_thread.run_sync(wait_for, condition, what)


# -- frozen --------------------------------------------------------------------------------


@contextmanager
def frozen(server: subprocess.Popen[bytes]) -> Iterator[None]:
    """The server stopped (SIGSTOP): connections stay open, nothing answers; SIGCONT after."""
    os.kill(server.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.pid, signal.SIGCONT)


def settle_after_freeze(call: Callable[[], Any], lease: timedelta) -> Any:
    """Call until it goes through. A reservation the frozen server received but answered too
    late is applied when it wakes, so the key may be in progress until that lease ends."""
    deadline = time.monotonic() + lease.total_seconds() + 10
    while True:
        try:
            return call()
        except RequestInProgressError:
            assert time.monotonic() < deadline, "the timed-out reservation's lease never ended"
            time.sleep(0.05)


def test_frozen_server_times_out_closed_then_resumes(port: int, tmp_path: Path) -> None:
    """While the server is frozen (SIGSTOP), concurrent guarded calls each raise
    StoreUnavailableError after the socket timeout and run nothing; after SIGCONT the same
    keys execute exactly once (at worst once the lease of a reservation the server applied
    late has ended) and replay."""
    lease = timedelta(seconds=1)
    store = RedisStore(
        url_of(port), prefix=prefix(), socket_timeout=TIMEOUT, socket_connect_timeout=TIMEOUT
    )
    idem = Idempotency(store, Policy(lease=lease))
    runs: Counter[str] = Counter()
    lock = threading.Lock()

    def guarded(key: str) -> Any:
        with idem.once(key, operation=OPERATION, payload=key) as a:
            if not a.replayed:
                with lock:
                    runs[key] += 1
                a.result = {"ran": key, "token": a.token}
        return a.result

    keys = [f"frozen-{n}" for n in range(CALLERS)]
    refused: list[BaseException | None] = [None] * CALLERS
    try:
        with durable_server(port, tmp_path) as server:
            warm = guarded("warm")
            assert warm["ran"] == "warm"
            with frozen(server):

                def attempt(index: int) -> None:
                    try:
                        guarded(keys[index])
                    except BaseException as exc:
                        refused[index] = exc

                threads = [threading.Thread(target=attempt, args=(i,)) for i in range(CALLERS)]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join(timeout=30)
                assert all(isinstance(exc, StoreUnavailableError) for exc in refused), refused
                assert sum(runs.values()) == 1  # only the warm-up ran

            for key in keys:
                first = settle_after_freeze(lambda key=key: guarded(key), lease)
                assert first["ran"] == key
                assert guarded(key) == first
            assert guarded("warm") == warm
    finally:
        store.close()
    assert runs == Counter(dict.fromkeys([*keys, "warm"], 1))


@pytest.mark.anyio
async def test_async_frozen_server_times_out_closed_then_resumes(port: int, tmp_path: Path) -> None:
    """The async store against a frozen server: concurrent tasks each raise
    StoreUnavailableError after the socket timeout and run nothing; after SIGCONT each key
    executes once and replays."""
    lease = timedelta(seconds=1)
    store = AsyncRedisStore(
        url_of(port), prefix=prefix(), socket_timeout=TIMEOUT, socket_connect_timeout=TIMEOUT
    )
    idem = AsyncIdempotency(store, Policy(lease=lease))
    runs: Counter[str] = Counter()

    async def guarded(key: str) -> Any:
        async with idem.once(key, operation=OPERATION, payload=key) as a:
            if not a.replayed:
                runs[key] += 1
                a.result = {"ran": key, "token": a.token}
        return a.result

    keys = [f"afrozen-{n}" for n in range(CALLERS)]
    refused: dict[str, BaseException] = {}

    async def attempt(key: str) -> None:
        try:
            await guarded(key)
        except BaseException as exc:
            refused[key] = exc

    try:
        with durable_server(port, tmp_path) as server:
            warm = await guarded("warm")
            assert warm["ran"] == "warm"
            with frozen(server):
                with anyio.fail_after(30):
                    async with anyio.create_task_group() as group:
                        for key in keys:
                            group.start_soon(attempt, key)
                assert set(refused) == set(keys)
                assert all(isinstance(e, StoreUnavailableError) for e in refused.values())
                assert runs == Counter({"warm": 1})

            deadline = time.monotonic() + lease.total_seconds() + 10
            for key in keys:
                while True:
                    try:
                        first = await guarded(key)
                        break
                    except RequestInProgressError:
                        assert time.monotonic() < deadline
                        await anyio.sleep(0.05)
                assert await guarded(key) == first
            assert await guarded("warm") == warm
    finally:
        await store.aclose()
    assert runs == Counter(dict.fromkeys([*keys, "warm"], 1))


# -- HTTP ----------------------------------------------------------------------------------


def payments_app(store: AsyncRedisStore, calls: Counter[str], **options: Any) -> Any:
    async def pay(request: Request) -> JSONResponse:
        body = await request.json()
        calls[body["order"]] += 1
        return JSONResponse({"paid": body["order"], "n": calls[body["order"]]}, status_code=201)

    app = Starlette(routes=[Route("/payments", pay, methods=["POST"])])
    return IdempotencyMiddleware(app, store=store, **options)


async def pay(client: httpx.AsyncClient, key: str, order: str) -> httpx.Response:
    return await client.post("/payments", json={"order": order}, headers={"Idempotency-Key": key})


def _client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test")


@pytest.mark.anyio
async def test_http_answers_503_while_redis_is_down_and_fails_open_when_asked(
    port: int, tmp_path: Path
) -> None:
    """With Redis killed the middleware answers 503 problem+json with Retry-After and the
    endpoint does not run; with fail_open=True it runs unguarded (a duplicate runs again);
    once Redis is back, requests run once and duplicates replay."""
    calls: Counter[str] = Counter()
    options = {"socket_timeout": TIMEOUT, "socket_connect_timeout": TIMEOUT}
    closed = AsyncRedisStore(url_of(port), prefix=prefix(), **options)
    opened = AsyncRedisStore(url_of(port), prefix=prefix(), **options)
    try:
        async with (
            _client(payments_app(closed, calls)) as client,
            _client(payments_app(opened, calls, fail_open=True)) as open_client,
        ):
            with durable_server(port, tmp_path) as server:
                assert (await pay(client, "k-up", "up")).status_code == 201
                kill(server)

            refused = await pay(client, "k-down", "down")
            assert refused.status_code == 503
            assert refused.headers["retry-after"] == "5"
            assert refused.headers["content-type"] == "application/problem+json"
            assert refused.json()["title"] == "Idempotency store unavailable"
            assert calls["down"] == 0

            for _ in range(2):
                unguarded = await pay(open_client, "k-open", "open")
                assert unguarded.status_code == 201
                assert "idempotent-replayed" not in unguarded.headers
            assert calls["open"] == 2  # fail-open means no idempotency at all

            with durable_server(port, tmp_path):
                first = await pay(client, "k-down", "down")
                again = await pay(client, "k-down", "down")
                assert (first.status_code, again.status_code) == (201, 201)
                assert again.content == first.content
                assert again.headers["idempotent-replayed"] == "true"
                replay_up = await pay(client, "k-up", "up")
                assert replay_up.headers["idempotent-replayed"] == "true"
            assert calls == Counter({"up": 1, "down": 1, "open": 2})
    finally:
        await closed.aclose()
        await opened.aclose()


# -- crashes: a holder SIGKILLed or frozen mid-work ----------------------------------------

REDIS_CHILD = r"""
import json, sys
from datetime import datetime, timedelta

from idempo import FencedError, Idempotency, Policy
from idempo.stores.redis import RedisStore

spec = json.loads(sys.argv[1])


def say(**message):
    print(json.dumps(message), flush=True)


store = RedisStore(spec["url"], prefix=spec["prefix"])
idem = Idempotency(store, Policy(lease=timedelta(seconds=spec["lease"])))
key = spec["key"]
try:
    with idem.once(key, operation=spec["operation"], payload={"key": key}) as a:
        assert not a.replayed
        store.client.rpush(spec["effects"], f"child:{a.token}")
        say(state="mid-work", token=a.token)
        sys.stdin.readline()  # killed here, or frozen here and then told to go on
        a.result = {"by": "child", "token": a.token}
except FencedError as exc:
    say(state="fenced", error=str(exc))
else:
    say(state="completed")
"""


class RedisChild(Child):
    """A child process holding a Redis reservation mid-work, spoken to like `Child`."""

    def __init__(self, url: str, prefix: str, key: str, log: Path) -> None:
        spec = {
            "url": url,
            "prefix": prefix,
            "key": key,
            "effects": effects_key(prefix, key),
            "lease": CRASH_LEASE.total_seconds(),
            "operation": CRASH_OPERATION,
        }
        self._start(REDIS_CHILD, spec, log)


def effects_key(prefix: str, key: str) -> str:
    """The Redis list each execution appends to: the work's own, committed effect."""
    return f"{prefix}:effects:{key}"


@contextmanager
def redis_child(url: str, prefix: str, key: str, tmp_path: Path) -> Iterator[RedisChild]:
    running = RedisChild(url, prefix, key, tmp_path / "child.log")
    try:
        yield running
    finally:
        running.close()


@dataclass
class RedisParent:
    """The parent's own attempts at a key (the shape of test_crashes' `Parent`): the work
    appends to the key's effects list."""

    store: RedisStore
    prefix: str
    executions: int = 0

    def attempt(
        self, key: str, *, clock: Callable[[], datetime] = utcnow, **policy: Any
    ) -> tuple[bool, Any]:
        """(replayed, result) of one guarded call."""
        idem = Idempotency(self.store, Policy(lease=CRASH_LEASE, clock=clock, **policy))
        with idem.once(key, operation=CRASH_OPERATION, payload={"key": key}) as a:
            if a.replayed:
                return True, a.result
            self.executions += 1
            self.store.client.rpush(effects_key(self.prefix, key), f"parent:{a.token}")
            a.result = {"by": "parent", "token": self.holder(key, a.token)}
        return False, a.result

    def holder(self, key: str, token: int) -> int:
        """Which holder of ``key`` ``token`` is, 1 for the first: Redis's tokens come from its
        clock, and test_crashes' helpers count holders ("the takeover is token 2")."""
        tokens = sorted({int(effect.split(":")[1]) for effect in self.effects(key)})
        return tokens.index(token) + 1

    def record(self, key: str) -> Any:
        return self.store.get(Scope.of(key, operation=CRASH_OPERATION))

    def effects(self, key: str) -> list[str]:
        return [e.decode() for e in self.store.client.lrange(effects_key(self.prefix, key), 0, -1)]


@pytest.fixture
def redis_parent(redis_at: tuple[str, str]) -> Iterator[RedisParent]:
    """The parent's store on the machine's server, then on the private cluster."""
    url, key_prefix = redis_at
    store = RedisStore(url, prefix=key_prefix)
    try:
        yield RedisParent(store, key_prefix)
    finally:
        store.close()


def test_sigkilled_holder_is_taken_over_after_its_lease(
    redis_at: tuple[str, str], redis_parent: RedisParent, tmp_path: Path
) -> None:
    """A child SIGKILLed mid-work leaves the key IN_PROGRESS: a duplicate is told so until
    the lease ends, then takes over with a larger token and executes once; the dead child's
    effect stays (the two-system gap: Redis cannot roll it back)."""
    parent = redis_parent
    key = new_key()
    with redis_child(*redis_at, key, tmp_path) as running:
        said = running.message()
        assert said["state"] == "mid-work"
        running.kill()

    child = said["token"]
    record = parent.record(key)
    assert (record.status, record.token) == (Status.IN_PROGRESS, child)
    assert parent.effects(key) == [f"child:{child}"]
    taken_over_once_the_lease_ends(parent, key, record.lease_expires_at, 1)  # holder ordinals
    record = parent.record(key)
    assert record.status is Status.COMPLETED
    assert record.token > child
    assert parent.effects(key) == [f"child:{child}", f"parent:{record.token}"]


def test_frozen_holder_is_fenced_after_a_takeover(
    redis_at: tuple[str, str], redis_parent: RedisParent, tmp_path: Path
) -> None:
    """A child frozen (SIGSTOP) past its lease while the parent takes over is refused with
    FencedError when it wakes (SIGCONT) and tries to complete: the stored outcome stays the
    new holder's, and every retry replays it."""
    parent = redis_parent
    key = new_key()
    with redis_child(*redis_at, key, tmp_path) as running:
        said = running.message()
        assert said["state"] == "mid-work"
        lease_end = parent.record(key).lease_expires_at
        result = fenced_on_waking(
            # The parent reports holders by ordinal (`RedisParent.holder`): the child is 1.
            running,
            lambda: take_over_after_expiry(parent, key, lease_end),
            1,
        )

    assert parent.attempt(key) == (True, result)
    assert parent.executions == 1
    record = parent.record(key)
    assert record.status is Status.COMPLETED
    assert record.token > said["token"]
    # The zombie's effect happened before it froze; its outcome was never stored.
    assert parent.effects(key) == [f"child:{said['token']}", f"parent:{record.token}"]
