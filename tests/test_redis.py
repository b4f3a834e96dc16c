"""The Redis store beyond the shared contract: races, key layout, URLs and failing closed.

The contract suite (tests/conformance) already runs against Redis, sync and async, on the
machine's server and on a private three-node cluster; here the Redis store faces many threads,
tasks and spawned processes at once, on both, and its own key naming. A server killed or frozen
mid-use: tests/test_redis_faults.py; the cluster's slots: tests/test_redis_cluster.py; tokens,
Redis's clock, undecodable records and evict: tests/test_redis_protocol.py; lost replies and
cancelled calls: tests/test_redis_wire.py.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis

from idempo import AsyncIdempotency, Idempotency, Scope
from idempo.errors import ConfigurationError
from idempo.stores import open_async_store, open_store
from idempo.stores.redis import AsyncRedisStore, RedisStore, _protocol
from test_races import (
    BARRIER_TIMEOUT,
    KEYS,
    POLICY,
    PROCESSES,
    TASKS,
    THREADS,
    AsyncCall,
    Call,
    Outcome,
    attempt,
    attempt_async,
    check_exactly_once,
    make_keys,
    race_tasks,
    race_threads,
    run_processes,
)

pytestmark = pytest.mark.redis


class Effects:
    """Side effects recorded in Redis itself (a list per key), visible across processes."""

    def __init__(self, url: str, prefix: str) -> None:
        self.url = url
        self.prefix = prefix

    def key(self, key: str) -> str:
        return f"{self.prefix}:effects:{key}"

    def effect(self, client: redis.Redis) -> Any:
        def effect(key: str, nonce: str) -> None:
            client.rpush(self.key(key), nonce)

        return effect

    def collect(self, keys: list[str]) -> dict[str, list[str]]:
        found: dict[str, list[str]] = defaultdict(list)
        reader = RedisStore(self.url, prefix=self.prefix)  # a server's client or a cluster's
        try:
            for key in keys:
                nonces = reader.client.lrange(self.key(key), 0, -1)
                if nonces:
                    found[key] = [n.decode() for n in nonces]
        finally:
            reader.close()
        return found


# -- races ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_threads_redis_store_executes_once_per_key(redis_at: tuple[str, str]) -> None:
    """32 threads released together at each of 200 keys on one RedisStore (a server or a
    cluster) execute each key exactly once."""
    redis_url, redis_prefix = redis_at
    store = RedisStore(redis_url, prefix=redis_prefix)
    effects = Effects(redis_url, redis_prefix)
    idem = Idempotency(store, POLICY)
    effect = effects.effect(store.client)

    @contextmanager
    def caller(worker: str) -> Iterator[Call]:
        yield lambda key: attempt(idem, key, worker, effect)

    keys = make_keys("redis")
    try:
        outcomes = race_threads(THREADS, keys, caller)
    finally:
        store.close()
    tally = check_exactly_once(outcomes, keys, THREADS, effects.collect(keys))
    assert tally.executed == KEYS


def _redis_process_main(
    url: str, prefix: str, index: int, keys: list[str], barrier: Any, results: Any
) -> None:
    """A spawned process: its own RedisStore, one guarded call per key at the barrier."""
    outcomes: list[Outcome] = []
    problem = None
    try:
        store = RedisStore(url, prefix=prefix)
        try:
            idem = Idempotency(store, POLICY)
            effect = Effects(url, prefix).effect(store.client)
            for key in keys:
                barrier.wait(timeout=BARRIER_TIMEOUT)
                outcomes.append(attempt(idem, key, f"process-{index}", effect))
        finally:
            store.close()
    except BaseException as exc:
        barrier.abort()
        problem = repr(exc)
    results.put((index, outcomes, problem))


@pytest.mark.slow
def test_processes_redis_store_execute_once_per_key(redis_at: tuple[str, str]) -> None:
    """4 spawned processes, each with its own RedisStore on a server or a cluster, released
    together at each of 200 keys execute each key exactly once."""
    redis_url, redis_prefix = redis_at
    keys = make_keys("redis-proc")
    outcomes = run_processes(_redis_process_main, (redis_url, redis_prefix), keys)
    effects = Effects(redis_url, redis_prefix).collect(keys)
    check_exactly_once(outcomes, keys, PROCESSES, effects)


@pytest.mark.slow
@pytest.mark.anyio
async def test_tasks_async_redis_store_executes_once_per_key(
    redis_url: str, redis_prefix: str
) -> None:
    """32 tasks released together at each of 200 keys on one AsyncRedisStore execute each key
    exactly once (on a cluster: tests/test_redis_cluster.py)."""
    store = AsyncRedisStore(redis_url, prefix=redis_prefix)
    idem = AsyncIdempotency(store, POLICY)
    effects = Effects(redis_url, redis_prefix)

    async def effect(key: str, nonce: str) -> None:
        await store.client.rpush(effects.key(key), nonce)

    def call_for(worker: str) -> AsyncCall:
        return lambda key: attempt_async(idem, key, worker, effect)

    keys = make_keys("aredis")
    try:
        outcomes = await race_tasks([call_for(f"task-{i}") for i in range(TASKS)], keys)
    finally:
        await store.aclose()
    check_exactly_once(outcomes, keys, TASKS, effects.collect(keys))


# -- keys, URLs, clients -------------------------------------------------------------------


@pytest.mark.parametrize("clock", ["redis", "given"])
def test_key_names_hold_no_user_strings(
    redis_store: RedisStore, redis_prefix: str, clock: str
) -> None:
    """A record's key is the prefix and a hash-tagged digest; the scope lives in the record,
    one string. Its key expires at the end of its retention on Redis's clock, that long
    after the caller's ``now`` plus the grace on a given one (which also lists it in the
    store's ``expiring`` set, by digest)."""
    now = None if clock == "redis" else datetime.now(UTC)
    scope = Scope.of("order*42", operation="POST /pay{x}", principal="tenant:1")
    redis_store.reserve(scope, "fp", now=now, lease=timedelta(seconds=5), ttl=timedelta(hours=1))
    # Read before the SCAN below, which walks a shared server's whole keyspace (seconds).
    pttl = redis_store.client.pttl(redis_store._keys.key(scope))

    keys = [k.decode() for k in redis_store.client.scan_iter(match=f"{redis_prefix}:*")]

    names = [k for k in keys if k != f"{redis_prefix}:expiring"]
    assert len(names) == 1
    tail = names[0].removeprefix(f"{redis_prefix}:")
    assert tail.startswith("{")
    assert tail.endswith("}")
    assert len(tail) == 66
    assert all(c in "0123456789abcdef" for c in tail[1:-1])
    assert redis_store.client.type(names[0]) == b"string"
    value = redis_store.client.get(names[0])
    expiry = redis_store.client.pexpiretime(names[0])
    record = _protocol.decode(value, None, expiry).record
    assert record is not None
    assert record.scope == scope
    assert b"tenant:1" + b"POST /pay{x}" + b"order*42" in value
    grace = 0 if now is None else 60
    assert (5 + 3600) * 1000 - 1000 < pttl <= (5 + 3600 + grace) * 1000
    listed = redis_store.client.zrange(f"{redis_prefix}:expiring", 0, -1)
    assert listed == ([] if now is None else [tail[1:-1].encode()])


def test_prefixes_are_separate_stores(redis_url: str, redis_prefix: str) -> None:
    """Two prefixes on one database neither see nor purge nor count each other's records."""
    now = datetime.now(UTC)
    scope = Scope.of("k", operation="op")
    first = RedisStore(redis_url, prefix=redis_prefix)
    second = RedisStore(redis_url, prefix=f"{redis_prefix}:nested")
    try:
        first.reserve(scope, "fp", now=now, lease=timedelta(seconds=1), ttl=timedelta(seconds=1))
        assert second.get(scope) is None
        assert second.stats() == {}
        assert second.purge(before=now + timedelta(days=1)) == 0
        assert first.stats() == {"in_progress": 1}
    finally:
        first.close()
        second.close()


@pytest.mark.anyio
async def test_urls_open_redis_stores(redis_url: str, redis_prefix: str) -> None:
    """redis:// URLs open both faces, with the prefix from the query string."""
    sync_store = open_store(f"{redis_url}?prefix={redis_prefix}")
    async_store = open_async_store(f"{redis_url}?prefix={redis_prefix}")
    try:
        assert isinstance(sync_store, RedisStore)
        assert isinstance(async_store, AsyncRedisStore)
        assert sync_store.client.ping()
        assert await async_store.client.ping()
        assert sync_store._keys.prefix == async_store._keys.prefix == redis_prefix
    finally:
        sync_store.close()
        await async_store.aclose()


def test_app_owned_clients_are_left_open(redis_url: str, redis_prefix: str) -> None:
    """A store on the app's client does not close it, and a decoding client is refused."""
    client = redis.Redis.from_url(redis_url)
    store = RedisStore(client=client, prefix=redis_prefix)
    store.close()
    assert client.ping()
    client.close()
    with pytest.raises(ConfigurationError):
        RedisStore(client=redis.Redis.from_url(redis_url, decode_responses=True))
    with pytest.raises(ConfigurationError):
        RedisStore()
