"""The Redis store on a real three-node Redis Cluster: one slot per record, every node used.

The session's private cluster (tests/redis_servers.py, started once by conftest) already runs
the whole store contract, sync and async, and the thread and process races
(tests/test_redis.py). Here: the cluster URL and client forms, proof that everything one
record touches lives in one slot on the node that owns it, and a load of many keys with
concurrent duplicates, every outcome and a purge, across all three primaries.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import redis.asyncio.cluster
import redis.cluster
import redis.exceptions

from idempo import (
    AsyncIdempotency,
    ConfigurationError,
    Policy,
    ReplayedFailureError,
    RequestInProgressError,
    Scope,
    StoreUnavailableError,
)
from idempo._core.record import Acquired
from idempo.stores import open_async_store, open_store
from idempo.stores.redis import AsyncRedisStore, RedisStore
from redis_servers import free_ports

pytestmark = pytest.mark.redis

LEASE = timedelta(seconds=30)
TTL = timedelta(hours=1)


def _first_seed(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("redis+cluster://").split(",", 1)[0].split(":")
    return host, int(port)


def _primaries(client: redis.cluster.RedisCluster) -> list[Any]:
    nodes: list[Any] = client.get_primaries()
    return nodes


def _keys_per_node(store: RedisStore, prefix: str) -> dict[str, int]:
    """How many of the prefix's keys each primary holds, asked on its own connection (which
    follows no redirection, so a key counts where it really lives)."""
    assert isinstance(store.client, redis.cluster.RedisCluster)
    counts = {}
    for node in _primaries(store.client):
        own = store.client.get_redis_connection(node)
        counts[node.name] = sum(1 for _ in own.scan_iter(match=f"{prefix}:*", count=1000))
    return counts


def moved_answers(store: RedisStore) -> int:
    """How many MOVED redirections the primaries have answered so far (INFO errorstats): a
    call sent straight to its slot's owner never gets one."""
    assert isinstance(store.client, redis.cluster.RedisCluster)
    total = 0
    for node in _primaries(store.client):
        stats: Any = store.client.get_redis_connection(node).info("errorstats")
        total += int(stats.get("errorstat_MOVED", {}).get("count", 0))
    return total


# -- URLs and clients ----------------------------------------------------------------------


@pytest.mark.anyio
async def test_cluster_urls_open_cluster_stores(
    redis_cluster_url: str, redis_cluster_prefix: str
) -> None:
    """A redis+cluster:// URL with several seed nodes opens a store on a cluster client, in
    both faces, with the prefix from the query string; the stores share their records."""
    url = f"{redis_cluster_url}?prefix={redis_cluster_prefix}"
    sync_store = open_store(url)
    async_store = open_async_store(url)
    scope = Scope.of("k", operation="op")
    now = datetime.now(UTC)
    try:
        assert isinstance(sync_store, RedisStore)
        assert isinstance(async_store, AsyncRedisStore)
        assert isinstance(sync_store.client, redis.cluster.RedisCluster)
        assert isinstance(async_store.client, redis.asyncio.cluster.RedisCluster)
        assert sync_store._keys.prefix == async_store._keys.prefix == redis_cluster_prefix
        assert len(_primaries(sync_store.client)) == 3

        reservation = await async_store.reserve(scope, "fp", now=now, lease=LEASE, ttl=TTL)
        assert isinstance(reservation, Acquired)
        record = sync_store.get(scope)
        assert record is not None
        assert record.token == reservation.token
    finally:
        sync_store.close()
        await async_store.aclose()


@pytest.mark.parametrize(
    "url",
    [
        "redis+cluster://127.0.0.1:7000/1",  # a cluster has database 0 only
        "redis+sentinel://127.0.0.1:26379/0",
        "redis+cluster://127.0.0.1:7000,127.0.0.1:notaport/0",
        "redis+cluster://127.0.0.1:7000,:7001/0",
    ],
)
def test_bad_cluster_urls_are_configuration_errors(url: str) -> None:
    """A cluster URL with a database other than 0, an unknown scheme suffix, or a malformed
    seed node is refused before anything connects."""
    with pytest.raises(ConfigurationError):
        open_store(url)
    with pytest.raises(ConfigurationError):
        open_async_store(url)


@pytest.mark.anyio
async def test_unreachable_cluster_fails_closed() -> None:
    """With no seed node answering, the sync store fails when it opens (the cluster client
    connects at once) and the async one on its first call: StoreUnavailableError both."""
    port, other = free_ports(2)
    url = f"redis+cluster://127.0.0.1:{port},127.0.0.1:{other}/0"
    with pytest.raises(StoreUnavailableError):
        RedisStore(url, socket_connect_timeout=0.5)
    store = AsyncRedisStore(url, socket_connect_timeout=0.5)
    try:
        with pytest.raises(StoreUnavailableError):
            await store.get(Scope.of("k", operation="op"))
    finally:
        await store.aclose()


@pytest.mark.anyio
async def test_app_owned_cluster_clients(redis_cluster_url: str, redis_cluster_prefix: str) -> None:
    """Stores run on the app's own RedisCluster clients and leave them open; a client that
    decodes responses is refused."""
    host, port = _first_seed(redis_cluster_url)
    client = redis.cluster.RedisCluster(host=host, port=port)
    aclient = redis.asyncio.cluster.RedisCluster(host=host, port=port)
    try:
        store = RedisStore(client=client, prefix=redis_cluster_prefix)
        astore = AsyncRedisStore(client=aclient, prefix=redis_cluster_prefix)
        scope = Scope.of("owned", operation="op")
        now = datetime.now(UTC)
        assert isinstance(store.reserve(scope, "fp", now=now, lease=LEASE, ttl=TTL), Acquired)
        assert (await astore.get(scope)) == store.get(scope)
        store.close()
        await astore.aclose()
        assert client.ping()
        assert await aclient.ping()
        with pytest.raises(ConfigurationError):
            RedisStore(
                client=redis.cluster.RedisCluster(host=host, port=port, decode_responses=True)
            )
    finally:
        client.close()
        await aclient.aclose()


# -- one slot per record -------------------------------------------------------------------

# Scopes whose strings would split a record over slots if they reached a key name: braces
# (Redis hash the text between the first { and the next }), empty tags, the longest key.
AWKWARD_SCOPES = [
    Scope.of("{a}", operation="{b}", principal="{c}"),
    Scope.of("x{}y", operation="POST /pay/{id}", principal="}{"),
    Scope.of("k" * 255, operation="op", principal="tenant:{1}"),
    Scope.of("plain", operation="op"),
]


@contextmanager
def recording(client: Any) -> Iterator[list[tuple[Any, ...]]]:
    """Every command ``client`` sends while the block runs, as its arguments."""
    sent: list[tuple[Any, ...]] = []
    send = client.execute_command

    def record(*args: Any, **kwargs: Any) -> Any:
        sent.append(args)
        return send(*args, **kwargs)

    client.execute_command = record
    try:
        yield sent
    finally:
        del client.execute_command


def keys_of(command: tuple[Any, ...]) -> list[Any]:
    """The key names in one of the store's commands (an unknown command fails the test, so a
    new kind of call must be taught here before it can slip past the check)."""
    name = str(command[0]).upper()
    if name == "EVALSHA":
        return list(command[3 : 3 + int(command[2])])
    if name in ("GET", "SET", "GETRANGE", "PEXPIRETIME", "ZRANGEBYSCORE", "ZADD", "ZREM"):
        return [command[1]]
    assert name in ("SCAN", "SCRIPT LOAD", "TIME"), command
    return []


def every_verb(store: RedisStore, scope: Scope, settle: Callable[..., None]) -> None:
    """Reserve, renew, lose the lease to a takeover, release, reserve afresh, settle, replay,
    read, evict and start again on Redis's clock: every kind of call one record gets."""
    now = datetime.now(UTC)
    short = timedelta(seconds=1)
    first = store.reserve(scope, "fp", now=now, lease=short, ttl=TTL)
    assert isinstance(first, Acquired)
    store.renew(scope, first.token, now=now, lease=short)
    later = now + timedelta(seconds=2)
    takeover = store.reserve(scope, "fp", now=later, lease=LEASE, ttl=TTL)
    assert isinstance(takeover, Acquired)
    assert takeover.token > first.token
    store.release(scope, takeover.token)
    fresh = store.reserve(scope, "fp", now=later, lease=LEASE, ttl=TTL)
    assert isinstance(fresh, Acquired)
    settle(scope, fresh.token, b"answer", now=later, ttl=TTL)
    assert not isinstance(store.reserve(scope, "fp", now=None, lease=LEASE, ttl=TTL), Acquired)
    assert store.get(scope) is not None
    assert store.evict(scope)
    again = store.reserve(scope, "fp", now=None, lease=LEASE, ttl=TTL)
    assert isinstance(again, Acquired)
    assert again.token > fresh.token
    settle(scope, again.token, b"answer", now=None, ttl=TTL)


def test_everything_a_record_touches_is_in_one_slot_on_its_owner(
    redis_cluster_store: RedisStore, redis_cluster_prefix: str
) -> None:
    """Every command a record's verbs send names one key, the record's own; Redis itself
    (CLUSTER KEYSLOT) puts that key in the slot of its hash tag whatever braces the scope
    holds, and the key lives on the primary that owns the slot and on no other. (A write on
    a clock the caller gave also lists the record in the store's ``expiring`` set: commands
    of their own, to that key's owner; purge reads that set first.)"""
    store = redis_cluster_store
    client = store.client
    assert isinstance(client, redis.cluster.RedisCluster)
    moved_before = moved_answers(store)
    touched: dict[Scope, set[Any]] = {}
    for n, scope in enumerate(AWKWARD_SCOPES):
        settle = store.complete if n % 2 else store.fail
        with recording(client) as sent:
            every_verb(store, scope, settle)
        touched[scope] = {key for command in sent for key in keys_of(command)}
    with recording(client) as sent:
        counts = store.stats()
        purged = store.purge(before=datetime.now(UTC) + timedelta(days=2))
    swept = {k if isinstance(k, bytes) else k.encode() for c in sent for k in keys_of(c)}

    assert counts == {"completed": 2, "failed": 2}
    assert purged == len(AWKWARD_SCOPES)
    assert moved_answers(store) == moved_before  # every call went straight to the owner
    names = {store._keys.key(scope).encode() for scope in AWKWARD_SCOPES}
    assert swept == {*names, store._keys.expiring.encode()}
    for scope, keys in touched.items():
        key = store._keys.key(scope)
        assert {k if isinstance(k, bytes) else k.encode() for k in keys} == {key.encode()}
        tag = key[key.index("{") + 1 : key.index("}")]
        assert client.cluster_keyslot(key) == client.cluster_keyslot(tag) == client.keyslot(key)

    # Where the records live: written again, then asked for on each primary's own connection,
    # which follows no redirection: the owner has the key, the others send us to the owner.
    for n, scope in enumerate(AWKWARD_SCOPES):
        every_verb(store, scope, store.complete if n % 2 else store.fail)
    for scope in AWKWARD_SCOPES:
        key = store._keys.key(scope)
        owner = client.get_node_from_key(key)
        for node in _primaries(client):
            own = client.get_redis_connection(node)
            if node.name == owner.name:
                assert own.exists(key) == 1
            else:
                with pytest.raises(redis.exceptions.MovedError, match=f"{owner.port}$"):
                    own.exists(key)


# -- many keys, concurrent duplicates, every node ------------------------------------------

LOAD_KEYS = 600
DUPLICATES = 4
BATCH = 25  # keys whose duplicates run at once: 100 concurrent calls


class Deterministic(Exception):
    """A failure the policy records (fail_on) and replays."""


class Transient(Exception):
    """A failure that releases the key, so a duplicate may run the work again."""


@pytest.mark.slow
@pytest.mark.anyio
async def test_load_of_duplicates_over_every_node_is_exact_and_purged(
    redis_cluster_url: str, redis_cluster_prefix: str
) -> None:
    """600 keys, 4 concurrent duplicates each, on a fresh async store over the cluster: no
    call errs (no CROSSSLOT) and none is redirected (each goes straight to its slot's owner),
    completing and failing work runs once per key, released work at most once per duplicate;
    every primary holds records (and the released keys their tombstones), both faces count
    them alike, and bounded purges sweep every node clean."""
    store = AsyncRedisStore(redis_cluster_url, prefix=redis_cluster_prefix)
    sync_store = RedisStore(redis_cluster_url, prefix=redis_cluster_prefix)
    try:
        moved_before = moved_answers(sync_store)
        expected = await load(store)
        # A fresh asyncio cluster client's first burst (100 calls at once) included.
        assert moved_answers(sync_store) == moved_before

        assert await store.stats() == expected
        assert sync_store.stats() == expected
        per_node = _keys_per_node(sync_store, redis_cluster_prefix)
        assert len(per_node) == 3
        assert all(count > 0 for count in per_node.values()), per_node
        released = LOAD_KEYS - sum(expected.values())  # a tombstone each, with its token
        assert sum(per_node.values()) == sum(expected.values()) + released

        # Purge in bounded batches, the faces taking turns, until nothing is left.
        later = datetime.now(UTC) + TTL + timedelta(days=1)
        batches = []
        while True:
            if len(batches) % 2:
                batch = sync_store.purge(before=later, limit=150)
            else:
                batch = await store.purge(before=later, limit=150)
            assert batch <= 150
            if not batch:
                break
            batches.append(batch)
        assert sum(batches) == sum(expected.values())
        assert len(batches) == -(-sum(expected.values()) // 150)
        assert sync_store.stats() == {}
        assert sum(_keys_per_node(sync_store, redis_cluster_prefix).values()) == 0
    finally:
        sync_store.close()
        await store.aclose()


async def load(store: AsyncRedisStore) -> dict[str, int]:
    """Fire LOAD_KEYS keys, DUPLICATES concurrent calls each, BATCH keys at a time; check
    every call's outcome and how often each key's work ran; the record count per state that
    should be left."""
    idem = AsyncIdempotency(store, Policy(lease=timedelta(minutes=5), fail_on=(Deterministic,)))
    runs: Counter[str] = Counter()
    outcomes: Counter[str] = Counter()
    errors: list[str] = []
    keys = [f"load-{uuid.uuid4().hex[:8]}-{n}" for n in range(LOAD_KEYS)]

    async def call(n: int) -> None:
        key = keys[n]
        try:
            async with idem.once(key, operation="load", payload={"n": n}) as attempt:
                if attempt.replayed:
                    outcomes["replayed"] += 1
                    return
                runs[key] += 1
                await anyio.lowlevel.checkpoint()  # let the duplicates arrive mid-work
                if n % 3 == 1:
                    raise Deterministic(key)
                if n % 3 == 2:
                    raise Transient(key)
                attempt.result = {"n": n}
            outcomes["executed"] += 1
        except RequestInProgressError:
            outcomes["in_progress"] += 1
        except ReplayedFailureError:
            outcomes["failure_replayed"] += 1
        except (Deterministic, Transient) as exc:
            outcomes[type(exc).__name__] += 1
        except Exception as exc:
            errors.append(repr(exc))

    for start in range(0, LOAD_KEYS, BATCH):
        async with anyio.create_task_group() as group:
            for n in range(start, min(start + BATCH, LOAD_KEYS)):
                for _ in range(DUPLICATES):
                    group.start_soon(call, n)
    assert errors == [], errors[:5]
    assert sum(outcomes.values()) == LOAD_KEYS * DUPLICATES
    settled = {0: "completed", 1: "failed"}
    for n, key in enumerate(keys):
        if n % 3 in settled:
            assert runs[key] == 1, (key, runs[key])
        else:
            assert 1 <= runs[key] <= DUPLICATES, (key, runs[key])
    expected = {name: sum(1 for n in range(LOAD_KEYS) if n % 3 == k) for k, name in settled.items()}
    assert outcomes["executed"] == expected["completed"]
    assert outcomes["Deterministic"] == expected["failed"]
    return expected
