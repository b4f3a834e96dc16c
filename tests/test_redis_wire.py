"""The Redis store on a wire that loses replies and callers that give up mid-command.

A `Proxy` sits on loopback between the store's client and the machine's Redis server and
forwards bytes both ways, except that it can be told to spring one trap on the next command
that carries given bytes (a script's SHA, or a fresh reservation's plain SET): drop the
connection right after the server answered (the server applied the command, the client never
hears it), or hold the command or its answer until the test lets go. redis-py 8 re-sends a
command whose connection broke (a client built by hand retries 10 times by default), so a lost
reply is a command run twice; a caller cancelled mid-command leaves redis-py to drop the
connection, and the store to undo what it may have reserved.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

import anyio
import anyio.to_thread
import pytest
import redis
import redis.asyncio

from idempo import AsyncIdempotency, Scope, Status, StoreUnavailableError
from idempo._core.record import Acquired
from idempo.stores.redis import AsyncRedisStore, RedisStore
from idempo.stores.redis._scripts import SCRIPTS
from test_redis_protocol import Face as StoreFace

pytestmark = [pytest.mark.redis, pytest.mark.anyio]

LEASE = timedelta(seconds=30)
TTL = timedelta(hours=1)
WAIT = 10.0  # seconds any step may take before the test fails instead of hanging

Action = Literal["drop-reply", "hold-command", "hold-reply"]


@dataclass
class Trap:
    """What to do to the next command carrying ``needle``; ``sprung`` is set once it did."""

    needle: bytes
    action: Action
    sprung: threading.Event = field(default_factory=threading.Event)
    go: threading.Event = field(default_factory=threading.Event)


class Proxy:
    """A loopback TCP proxy in front of ``upstream``, with traps set one command at a time."""

    def __init__(self, upstream: tuple[str, int], db: int = 0) -> None:
        self.upstream = upstream
        self.db = db  # the upstream's database: clients through the proxy select it too
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self.traps: list[Trap] = []
        self.connections = 0
        self.lock = threading.Lock()
        self.sockets: list[socket.socket] = []
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    @property
    def url(self) -> str:
        """A redis:// URL through the proxy, to the upstream's database."""
        return f"redis://127.0.0.1:{self.port}/{self.db}"

    def trap(self, needle: bytes, action: Action) -> Trap:
        """Spring ``action`` on the next command that carries ``needle`` (after any earlier
        traps have sprung)."""
        trap = Trap(needle, action)
        with self.lock:
            self.traps.append(trap)
        return trap

    def _take(self, data: bytes) -> Trap | None:
        with self.lock:
            if self.traps and self.traps[0].needle in data:
                return self.traps.pop(0)
        return None

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            with self.lock:
                self.connections += 1
                self.sockets += [client, server]
            # The server-to-client pump learns from the other what to do with the next answer.
            answers: list[Trap] = []
            for source, sink, pump in ((client, server, True), (server, client, False)):
                thread = threading.Thread(
                    target=self._pump, args=(source, sink, pump, answers), daemon=True
                )
                self.threads.append(thread)
                thread.start()

    def _pump(
        self, source: socket.socket, sink: socket.socket, commands: bool, answers: list[Trap]
    ) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                trap = self._take(data) if commands else (answers.pop(0) if answers else None)
                if trap is None:
                    sink.sendall(data)
                elif commands and trap.action == "hold-command":
                    trap.sprung.set()
                    trap.go.wait(WAIT)
                    # Sent even if the client is gone: a command already on the wire arrives.
                    sink.sendall(data)
                elif commands:
                    answers.append(trap)
                    sink.sendall(data)
                elif trap.action == "drop-reply":
                    # The server has answered, so it applied the command; the client never
                    # hears it.
                    self._cut(source, sink)
                    trap.sprung.set()
                    return
                else:  # hold-reply
                    trap.sprung.set()
                    trap.go.wait(WAIT)
                    sink.sendall(data)
        self._cut(source, sink)

    @staticmethod
    def _cut(*sockets: socket.socket) -> None:
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._cut(self.listener)  # wakes the accept; closing alone would not
        self.listener.close()
        with self.lock:
            for trap in self.traps:
                trap.go.set()
            self._cut(*self.sockets)
        for thread in self.threads:
            thread.join(WAIT)
        for sock in self.sockets:
            sock.close()


@pytest.fixture
def proxy(redis_url: str) -> Iterator[Proxy]:
    """A proxy in front of the machine's Redis server."""
    target = redis.Redis.from_url(redis_url).connection_pool.connection_kwargs
    p = Proxy(
        (target.get("host", "127.0.0.1"), int(target.get("port", 6379))), int(target.get("db", 0))
    )
    try:
        yield p
    finally:
        p.close()


def _load_scripts(redis_url: str) -> None:
    """Load every script once, directly: a first EVALSHA answered NOSCRIPT (and re-sent by
    redis-py) would spring a trap without running anything."""
    with redis.Redis.from_url(redis_url) as direct:
        for text in SCRIPTS.values():
            direct.script_load(text)


class Face(StoreFace):
    """A store of either face behind awaited verbs, with what the proxy's traps look for."""

    def needle(self, verb: str) -> bytes:
        """What the command ``verb`` sends carries: a fresh reservation is a plain SET (in
        RESP, the command's name as a bulk string), the others the SHA of their script."""
        if verb == "reserve":
            return b"$3\r\nSET\r\n"
        name = {"complete": "settle", "fail": "settle"}.get(verb, verb)
        return str(self.store._scripts[name].sha).encode()


@pytest.fixture(
    params=[
        pytest.param(("sync", "client"), id="sync-own-client"),
        pytest.param(("async", "client"), id="async-own-client"),
        pytest.param(("sync", "url"), id="sync-url"),
        pytest.param(("async", "url"), id="async-url"),
    ]
)
async def face(
    request: pytest.FixtureRequest, proxy: Proxy, redis_url: str, redis_prefix: str
) -> Any:
    """A store of each face through the proxy: on an app's client built by hand (which
    redis-py makes retry ten times), or built by the store from a URL (once)."""
    _load_scripts(redis_url)
    kind, built = request.param
    options: dict[str, Any] = {"socket_timeout": WAIT}
    store: RedisStore | AsyncRedisStore
    if built == "url":
        url = proxy.url
        store = (RedisStore if kind == "sync" else AsyncRedisStore)(
            url, prefix=redis_prefix, **options
        )
    elif kind == "sync":
        store = RedisStore(
            client=redis.Redis(port=proxy.port, db=proxy.db, **options), prefix=redis_prefix
        )
    else:
        aclient = redis.asyncio.Redis(port=proxy.port, db=proxy.db, **options)
        store = AsyncRedisStore(client=aclient, prefix=redis_prefix)
    try:
        yield Face(store)
    finally:
        if isinstance(store, RedisStore):
            store.close()
            store.client.close()
        else:
            await store.aclose()
            await store.client.aclose()


@pytest.fixture
def direct(redis_url: str, redis_prefix: str) -> Iterator[RedisStore]:
    """A second store on the same prefix that talks to Redis without the proxy."""
    store = RedisStore(redis_url, prefix=redis_prefix)
    try:
        yield store
    finally:
        store.close()


async def sprung(trap: Trap) -> None:
    assert await anyio.to_thread.run_sync(trap.sprung.wait, WAIT), trap


def scope(key: str = "k-1") -> Scope:
    return Scope.of(key, operation="charge", principal="alice")


# -- lost replies ----------------------------------------------------------------------------


async def test_reserve_whose_reply_was_lost_is_acquired_when_resent(
    face: Face, proxy: Proxy, direct: RedisStore
) -> None:
    """A reserve the server applied but whose reply the connection lost is re-sent by redis-py;
    it finds its own reservation and acquires it, instead of reporting the key "in progress"
    for a whole lease."""
    trap = proxy.trap(face.needle("reserve"), "drop-reply")

    reservation = await face.reserve(scope(), "fp", now=None, lease=LEASE, ttl=TTL)

    assert trap.sprung.is_set()
    assert proxy.connections == 2  # the re-sent command went on a new connection
    assert isinstance(reservation, Acquired), reservation
    record = direct.get(scope())
    assert record is not None
    assert (record.status, record.token) == (Status.IN_PROGRESS, reservation.token)
    await face.complete(scope(), reservation.token, b"done", now=None, ttl=TTL)
    done = direct.get(scope())
    assert done is not None
    assert (done.status, done.response) == (Status.COMPLETED, b"done")


@pytest.mark.parametrize("verb", ["complete", "fail", "renew"])
async def test_settle_or_renew_whose_reply_was_lost_succeeds_when_resent(
    face: Face, proxy: Proxy, direct: RedisStore, verb: str
) -> None:
    """A complete, fail or renew applied but unanswered succeeds when redis-py re-sends it."""
    reservation = await face.reserve(scope(), "fp", now=None, lease=LEASE, ttl=TTL)
    assert isinstance(reservation, Acquired)
    trap = proxy.trap(face.needle(verb), "drop-reply")

    if verb == "renew":
        await face.renew(scope(), reservation.token, now=None, lease=LEASE)
    else:
        await getattr(face, verb)(scope(), reservation.token, b"answer", now=None, ttl=TTL)

    assert trap.sprung.is_set()
    record = direct.get(scope())
    assert record is not None
    expected = {"complete": Status.COMPLETED, "fail": Status.FAILED, "renew": Status.IN_PROGRESS}
    assert (record.status, record.token) == (expected[verb], reservation.token)


async def test_release_resent_late_leaves_a_newer_reservation_alone(
    face: Face, proxy: Proxy, direct: RedisStore
) -> None:
    """A release applied but unanswered, re-sent by redis-py only after another caller
    reserved the freed key, cannot delete that caller's reservation: its token is new."""
    reservation = await face.reserve(scope(), "fp", now=None, lease=LEASE, ttl=TTL)
    assert isinstance(reservation, Acquired)
    lost = proxy.trap(face.needle("release"), "drop-reply")
    resent = proxy.trap(face.needle("release"), "hold-command")

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(face.release, scope(), reservation.token)
        await sprung(lost)
        await sprung(resent)
        newer = direct.reserve(scope(), "fp", now=None, lease=LEASE, ttl=TTL)
        assert isinstance(newer, Acquired)
        resent.go.set()

    record = direct.get(scope())
    assert record is not None
    assert (record.status, record.token) == (Status.IN_PROGRESS, newer.token)
    assert newer.token > reservation.token


# -- cancellation ----------------------------------------------------------------------------


def _awaiting(task: asyncio.Task[Any]) -> list[str]:
    """The names of the coroutines ``task`` is suspended in, outermost first."""
    names, coro = [], task.get_coro()
    while coro is not None:
        names.append(getattr(coro, "__qualname__", type(coro).__name__))
        coro = getattr(coro, "cr_await", None)
    return names


async def reading(task: asyncio.Task[Any], started: Trap) -> None:
    """Once the trap has sprung, until ``task`` waits for the answer the proxy holds.

    Only then is a cancellation sure to reach it: Python 3.11's ``asyncio.wait_for``, which
    redis-py sends a command under, drops a cancellation that lands in the loop step where
    the send finishes (fixed in 3.12), and the command then simply goes on to completion.
    """
    await sprung(started)
    for _ in range(10_000):
        chain = _awaiting(task)
        if any(name.endswith(".read_response") for name in chain) and "wait_for" not in chain:
            return
        await asyncio.sleep(0)
    pytest.fail(f"the call never waited for its answer: {_awaiting(task)}")


async def cancel_task(call: Callable[[], Awaitable[Any]], started: Trap) -> None:
    task = asyncio.ensure_future(call())
    await reading(task, started)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def asyncio_timeout(call: Callable[[], Awaitable[Any]], started: Trap) -> None:
    async def cancel_when_sprung(deadline: asyncio.Timeout, caller: asyncio.Task[Any]) -> None:
        await reading(caller, started)
        deadline.reschedule(asyncio.get_running_loop().time())

    async def timed() -> None:
        caller = asyncio.current_task()
        assert caller is not None
        async with asyncio.timeout(None) as deadline:
            watcher = asyncio.ensure_future(cancel_when_sprung(deadline, caller))
            try:
                await call()
            finally:
                await watcher

    with pytest.raises(TimeoutError):
        await timed()


async def anyio_move_on(call: Callable[[], Awaitable[Any]], started: Trap) -> None:
    caller = asyncio.current_task()
    assert caller is not None
    with anyio.CancelScope() as cancel_scope:
        async with anyio.create_task_group() as tasks:

            async def cancel_when_sprung() -> None:
                await reading(caller, started)
                cancel_scope.cancel()

            tasks.start_soon(cancel_when_sprung)
            await call()
            pytest.fail("the call was not cancelled")  # pragma: no cover
    assert cancel_scope.cancelled_caught


CANCELS = [
    pytest.param(cancel_task, id="task-cancel"),
    pytest.param(asyncio_timeout, id="asyncio-timeout"),
    pytest.param(anyio_move_on, id="anyio-cancel-scope"),
]


@pytest.fixture
async def aface(proxy: Proxy, redis_url: str, redis_prefix: str) -> Any:
    """An AsyncRedisStore through the proxy, on a client it built from a URL."""
    _load_scripts(redis_url)
    store = AsyncRedisStore(proxy.url, prefix=redis_prefix, socket_timeout=WAIT)
    try:
        yield Face(store)
    finally:
        await store.aclose()


@pytest.mark.parametrize("cancel", CANCELS)
async def test_cancelled_reserve_leaves_neither_a_reply_in_the_pool_nor_the_key_wedged(
    aface: Face, proxy: Proxy, direct: RedisStore, cancel: Any
) -> None:
    """A reserve cancelled after Redis applied it, while its answer is on the wire, leaves no
    unread reply on a pooled connection (the next commands get their own answers) and no
    reservation behind: the key is free for the next caller."""
    store = aface.store
    assert isinstance(store, AsyncRedisStore)
    trap = proxy.trap(aface.needle("reserve"), "hold-reply")

    await cancel(lambda: store.reserve(scope(), "fp", now=None, lease=LEASE, ttl=TTL), trap)
    trap.go.set()
    await store._drain()

    assert direct.get(scope()) is None
    for key in ("a", "b"):
        reservation = await store.reserve(scope(key), "fp", now=None, lease=LEASE, ttl=TTL)
        assert isinstance(reservation, Acquired), reservation
        mine = await store.get(scope(key))
        assert mine is not None
        assert mine == direct.get(scope(key))
    assert isinstance(await store.reserve(scope(), "fp", now=None, lease=LEASE, ttl=TTL), Acquired)


class Charge:
    """A guarded charge of one key on ``store``; ``runs`` counts its executions."""

    def __init__(self, store: AsyncRedisStore) -> None:
        self.idem = AsyncIdempotency(store)
        self.runs = 0

    async def __call__(self) -> None:
        async with self.idem.once("k-1", operation="charge", principal="alice") as attempt:
            if not attempt.replayed:
                self.runs += 1
                attempt.result = "charged"


async def test_a_guarded_reserve_cancelled_on_its_way_is_undone_after_it_lands(
    aface: Face, proxy: Proxy, direct: RedisStore
) -> None:
    """A guarded call cancelled while its reservation is still on its way to Redis (held in
    the network): the undo leaves only once the reservation's reply has been read, so it
    reaches Redis after the reservation, whichever connection each travels on, and the key
    is free when the caller hears its cancellation. An undo sent at once on another
    connection would overtake it, find nothing, and leave the key held for a lease."""
    store = aface.store
    assert isinstance(store, AsyncRedisStore)
    charge = Charge(store)
    on_its_way = proxy.trap(aface.needle("reserve"), "hold-command")
    overtaking = proxy.trap(aface.needle("release"), "hold-reply")

    task = asyncio.ensure_future(charge())
    try:
        await reading(task, on_its_way)
        task.cancel()
        # An undo that does not wait for the reservation gets the time to overtake it (a
        # bounded wait for what must not happen), then the reservation lands.
        overtook = await anyio.to_thread.run_sync(overtaking.sprung.wait, 0.5)
        overtaking.go.set()
        on_its_way.go.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        found = direct.get(scope())
    finally:
        on_its_way.go.set()
        overtaking.go.set()
    assert not overtook, "the undo reached Redis before the reservation it undoes"
    assert found is None, "the key was held when the caller heard"
    await charge()
    assert charge.runs == 1


async def test_a_guarded_reserve_whose_reply_timed_out_is_undone_by_its_nonce(
    proxy: Proxy, direct: RedisStore, redis_url: str, redis_prefix: str
) -> None:
    """What the guard's own shield cannot cover: Redis applied a reserve whose reply never came
    (the socket timed out), so the guard holds no token to release and raises
    StoreUnavailableError. The store undoes the reservation by its nonce, so a retry runs the
    work at once instead of answering "in progress" until the lease ends."""
    _load_scripts(redis_url)
    store = AsyncRedisStore(proxy.url, prefix=redis_prefix, socket_timeout=0.5)
    charge = Charge(store)
    trap = proxy.trap(Face(store).needle("reserve"), "hold-reply")

    try:
        with pytest.raises(StoreUnavailableError):
            await charge()
        assert trap.sprung.is_set()
        await store._drain()
        assert direct.stats() == {}  # Redis had reserved it; the undo deleted it
        trap.go.set()
        await charge()
        await charge()
    finally:
        trap.go.set()
        await store.aclose()
    assert charge.runs == 1


@pytest.mark.parametrize("cancel", CANCELS)
@pytest.mark.parametrize("verb", ["complete", "renew", "release"])
async def test_cancelled_settle_renew_or_release_leaves_the_pool_sound(
    aface: Face, proxy: Proxy, direct: RedisStore, cancel: Any, verb: str
) -> None:
    """A complete, renew or release cancelled while its answer is on the wire leaves no unread
    reply in the pool, and the holder can still finish: the record ends as its own token
    says, never in the hands of a stale reply."""
    store = aface.store
    assert isinstance(store, AsyncRedisStore)
    reservation = await store.reserve(scope(), "fp", now=None, lease=LEASE, ttl=TTL)
    assert isinstance(reservation, Acquired)
    token = reservation.token
    calls: dict[str, Callable[[], Awaitable[Any]]] = {
        "complete": lambda: store.complete(scope(), token, b"ok", now=None, ttl=TTL),
        "renew": lambda: store.renew(scope(), token, now=None, lease=LEASE),
        "release": lambda: store.release(scope(), token),
    }
    trap = proxy.trap(aface.needle(verb), "hold-reply")

    await cancel(calls[verb], trap)
    trap.go.set()

    other = await store.reserve(scope("other"), "fp", now=None, lease=LEASE, ttl=TTL)
    assert isinstance(other, Acquired)
    assert await store.get(scope("other")) == direct.get(scope("other"))
    record = direct.get(scope())
    if verb == "release":
        assert record is None
    else:
        assert record is not None
        assert record.token == token
        await store.complete(scope(), token, b"ok", now=None, ttl=TTL)  # a retry of it: fine
        assert await store.get(scope()) == direct.get(scope())
