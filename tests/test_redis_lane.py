"""The store's own client sends its hot commands on connections it keeps (`_lane.Lane`):
shared by threads, safe across a fork, never handing a half-read reply to the next caller,
re-sending once on a broken connection; an app's client carries every command itself."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import multiprocessing
import secrets
import threading
from datetime import timedelta
from typing import Any

import pytest
import redis
import redis.asyncio

from idempo import Idempotency
from idempo._core.keys import Scope
from idempo._core.record import Acquired, Replay
from idempo.stores.redis import AsyncRedisStore, RedisStore, _protocol

pytestmark = pytest.mark.redis

LEASE, TTL = timedelta(seconds=30), timedelta(minutes=5)


@pytest.fixture
def store(redis_url: str) -> Any:
    prefix = f"lane-{secrets.token_hex(4)}"
    store = RedisStore(redis_url, prefix=prefix)
    yield store
    store.close()
    with redis.Redis.from_url(redis_url) as client:
        for key in client.scan_iter(f"{prefix}:*"):
            client.delete(key)


def reserve(store: RedisStore, key: str) -> Any:
    return store.reserve(Scope("", "pay", key), "fp", now=None, lease=LEASE, ttl=TTL)


def test_threads_share_the_kept_connections_and_every_call_is_answered(store: Any) -> None:
    idem = Idempotency(store)
    runs: list[str] = []
    lock = threading.Lock()

    def work(key: str) -> str:
        with idem.once(key, operation="pay") as attempt:
            if not attempt.replayed:
                with lock:
                    runs.append(key)
                attempt.result = key
        return str(attempt.result)

    def caller(n: int) -> None:
        for i in range(40):
            key = f"k{n}-{i % 5}"  # each key run once, then replayed
            assert work(key) == key

    threads = [threading.Thread(target=caller, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(runs) == sorted(f"k{n}-{i}" for n in range(8) for i in range(5))
    assert 1 <= len(store._lane._idle) <= 8  # one per caller at most, kept for the next


def test_a_connection_killed_between_calls_is_sent_again(store: Any, redis_url: str) -> None:
    reserve(store, "a")
    (conn,) = store._lane._idle
    with redis.Redis.from_url(redis_url) as admin:
        conn.send_command("CLIENT", "ID")
        mine = conn.read_response()
        assert admin.client_kill_filter(_id=mine) == 1
    assert reserve(store, "b").token > 0  # the broken socket is found, reconnected, re-sent


def test_an_interrupted_read_never_reaches_the_next_caller(store: Any) -> None:
    reserve(store, "a")
    (conn,) = store._lane._idle
    real = conn.read_response

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        conn.read_response = real
        raise KeyboardInterrupt  # the reply is left unread on the socket

    conn.read_response = interrupted
    with pytest.raises(KeyboardInterrupt):
        reserve(store, "b")
    # The SET of "b" ran. The connection was dropped, so asking for "b" again reads the
    # answer to this ask (the record in progress), not the first one's ("created").
    assert not isinstance(reserve(store, "b"), Acquired)
    assert isinstance(reserve(store, "c"), Acquired)


def _child(store: Any, out: Any) -> None:
    try:
        reserve(store, "child")
        (conn,) = store._lane._idle
        conn.send_command("CLIENT", "ID")
        out.put(conn.read_response())
    except BaseException as exc:  # reported to the parent
        out.put(repr(exc))


def test_after_a_fork_the_child_uses_connections_of_its_own(store: Any) -> None:
    reserve(store, "parent")
    (conn,) = store._lane._idle
    conn.send_command("CLIENT", "ID")
    parent_id = conn.read_response()
    context = multiprocessing.get_context("fork")
    out = context.Queue()
    child = context.Process(target=_child, args=(store, out))
    child.start()
    child_id = out.get(timeout=30)
    child.join(30)
    assert isinstance(child_id, int), child_id
    assert child_id != parent_id
    assert reserve(store, "parent-again").token > 0  # the parent's socket is intact


def _nonce(store: Any, key: str) -> bytes:
    """The nonce of ``key``'s reservation, as its record holds it (header bytes 43-50)."""
    name = _protocol.named(store._keys.prefix, Scope("", "pay", key))[0]
    value = store.client.get(name)
    assert value is not None
    return bytes(value[42:50])


def _child_reserves(store: Any, key: str, out: Any) -> None:
    try:
        reserve(store, key)
        out.put(_nonce(store, key))
    except BaseException as exc:  # reported to the parent
        out.put(repr(exc))


def test_a_forked_child_draws_nonces_of_its_own(store: Any) -> None:
    """A reservation's nonce is how a re-sent reserve knows its own reservation: a child
    that drew the same nonces as its parent could take the parent's reservation for its
    own. They come from the random module, which reseeds in a forked child."""
    reserve(store, "before-the-fork")
    context = multiprocessing.get_context("fork")
    out = context.Queue()
    child = context.Process(target=_child_reserves, args=(store, "child-first", out))
    child.start()
    reserve(store, "parent-first")  # the parent's first draw after the fork, as the child's
    child_nonce = out.get(timeout=30)
    child.join(30)
    assert isinstance(child_nonce, bytes), child_nonce
    assert child_nonce != _nonce(store, "parent-first")


def test_an_apps_client_carries_every_command_itself(redis_url: str) -> None:
    sent: list[Any] = []

    class Counting(redis.Redis):
        def execute_command(self, *args: Any, **options: Any) -> Any:
            sent.append(args[0])
            return super().execute_command(*args, **options)

    prefix = f"lane-{secrets.token_hex(4)}"
    with Counting.from_url(redis_url) as client:
        store = RedisStore(client=client, prefix=prefix)
        assert store._lane is None
        with Idempotency(store).once("k", operation="pay") as attempt:
            attempt.result = 1
        assert {"SET", "EVALSHA"} <= set(sent)
        for key in client.scan_iter(f"{prefix}:*"):
            client.delete(key)


@pytest.fixture
async def async_store(redis_url: str) -> Any:
    prefix = f"lane-{secrets.token_hex(4)}"
    store = AsyncRedisStore(redis_url, prefix=prefix)
    yield store
    await store.aclose()
    with redis.Redis.from_url(redis_url) as client:
        for key in client.scan_iter(f"{prefix}:*"):
            client.delete(key)


async def areserve(store: AsyncRedisStore, key: str) -> Any:
    return await store.reserve(Scope("", "pay", key), "fp", now=None, lease=LEASE, ttl=TTL)


@pytest.mark.anyio
async def test_async_tasks_share_the_kept_connections(async_store: Any) -> None:
    keys = [f"k{i}" for i in range(40)]
    first = await asyncio.gather(*(areserve(async_store, key) for key in keys))
    again = await asyncio.gather(*(areserve(async_store, key) for key in keys))
    assert all(isinstance(r, Acquired) for r in first)
    assert not any(isinstance(r, Acquired) for r in again)  # each one's own answer
    assert 1 <= len(async_store._lane._idle) <= len(keys)


@pytest.mark.anyio
async def test_a_cancelled_async_call_leaves_no_reply_for_the_next(async_store: Any) -> None:
    await areserve(async_store, "warm")
    for n in range(20):
        task = asyncio.ensure_future(areserve(async_store, f"c{n}"))
        for _ in range(n % 4):
            await asyncio.sleep(0)  # cancelled before, during or after the send
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        # Whatever the cancelled call did (undone by its nonce if it took the key), the
        # next call on the kept connection reads its own reply.
        assert isinstance(await areserve(async_store, f"fresh{n}"), Acquired)
        assert not isinstance(await areserve(async_store, f"fresh{n}"), Acquired)


async def _done(value: Any) -> Any:
    """A verb's result on either face."""
    return await value if inspect.isawaitable(value) else value


@pytest.mark.anyio
@pytest.mark.parametrize("face", ["sync", "async"])
async def test_a_script_the_server_lost_is_loaded_again_and_run(face: str) -> None:
    """A server that lost its scripts (a restart, ``SCRIPT FLUSH``) answers NOSCRIPT: the
    store loads the script and runs it again (the async store on its lane). On a private
    server: flushing the machine's would make other suites' first scripts reload."""
    from redis_servers import free_ports, installed, redis_server

    if installed():
        pytest.skip(f"no redis-server to start: {installed()}")
    (port,) = free_ports(1)
    s = Scope("", "pay", "k-lost")
    with redis_server(port):
        url = f"redis://127.0.0.1:{port}/0"
        store = (RedisStore if face == "sync" else AsyncRedisStore)(url, prefix="lane")
        try:
            reserved = await _done(store.reserve(s, "fp", now=None, lease=LEASE, ttl=TTL))
            assert isinstance(reserved, Acquired)
            await _done(store.client.script_flush())
            await _done(store.complete(s, reserved.token, b"ok", now=None, ttl=TTL))
            replay = await _done(store.reserve(s, "fp", now=None, lease=LEASE, ttl=TTL))
        finally:
            await _done(store.close() if isinstance(store, RedisStore) else store.aclose())
    assert isinstance(replay, Replay)
    assert replay.record.response == b"ok"


@pytest.mark.anyio
async def test_an_apps_async_client_carries_every_command_itself(redis_url: str) -> None:
    client = redis.asyncio.Redis.from_url(redis_url)
    store = AsyncRedisStore(client=client, prefix=f"lane-{secrets.token_hex(4)}")
    assert store._lane is None
    await store.aclose()
    await client.aclose()


def test_a_client_side_cache_keeps_redis_pys_own_path(redis_url: str) -> None:
    """redis-py reads a cache's invalidations on each command. (Caching needs Redis 7.4:
    this server refuses it on connecting, so only the choice is checked.)"""
    from redis.cache import CacheConfig

    store = RedisStore(redis_url, prefix="lane-cache", protocol=3, cache_config=CacheConfig())
    try:
        assert store._lane is None
    finally:
        store.close()


COMMANDS = [
    ("SET", "idempo:{ab12}", b"i\x00d" * 50, "NX", "GET", "PX", 86_430_000),
    ("EVALSHA", "0" * 40, 1, "p:{é}", "", 30_000_000, b"\x00\xff", -1),
]


@pytest.mark.parametrize("encoding", ["utf-8", "UTF8", "latin-1"])
@pytest.mark.parametrize("face", ["sync", "async"])
def test_a_lane_packs_a_command_as_redis_py_would(encoding: str, face: str) -> None:
    """The lane packs its commands itself (hiredis's packer where the client's encoding is
    UTF-8, else each argument through the client's encoder): byte for byte redis-py's."""
    import hiredis

    from idempo.stores.redis._lane import _packed, packer

    kind = redis.Redis if face == "sync" else redis.asyncio.Redis
    client = kind(encoding=encoding)  # never connects
    conn = client.connection_pool.make_connection()
    pack = packer(client.get_encoder())
    for command in COMMANDS:
        expected = b"".join(conn.pack_command(*command))
        assert pack(command) == expected
        assert _packed(client.get_encoder().encode, command) == expected
    assert (pack is hiredis.pack_command) == (encoding != "latin-1")
