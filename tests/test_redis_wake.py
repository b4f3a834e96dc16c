"""Waking a duplicate on Redis while most settles publish nothing.

A fresh reservation's settle publishes only once a waiter marked the record (`wait_settled`
subscribes to the record's key name, then runs lua/mark.lua, which makes the record one on
Redis's clock); every other settle, release or ended lease publishes. Shown here: what a
settle publishes, marked or not; a waiter and a settle arriving in any order, many times
over, never leave the waiter waiting; the mark changes nothing a reader sees; a process of
the previous version (whose settle always publishes) settles a marked record as before. The
guard's own wake-ups (counted reservations) are in tests/test_wake.py.
"""

from __future__ import annotations

import asyncio
import functools
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from idempo import FencedError, Scope, Status
from idempo._core.record import Acquired, Replay
from idempo.stores.redis import AsyncRedisStore, RedisStore, _ops
from test_wake import DEADLINE, meet

pytestmark = pytest.mark.redis

LEASE = timedelta(seconds=30)
TTL = timedelta(hours=1)
PREVIOUS = Path(__file__).parent / "redis_previous_settle"


@pytest.fixture(params=["redis_store", "redis_cluster_store"], ids=["server", "cluster"])
def store(request: pytest.FixtureRequest) -> RedisStore:
    """A sync Redis store: the machine's server, then the private cluster."""
    found: RedisStore = request.getfixturevalue(request.param)
    return found


def held(store: RedisStore, key: str) -> tuple[Scope, int]:
    """A fresh reservation of ``key`` (a plain SET: a record whose times derive from its
    key's expiry) and its token."""
    scope = Scope.of(key, operation="charge", principal="alice")
    got = store.reserve(scope, "fp", now=None, lease=LEASE, ttl=TTL)
    assert isinstance(got, Acquired), got
    return scope, got.token


def mark(store: RedisStore, scope: Scope) -> bool:
    return store._drive(_ops.mark(store._keys, scope))


def published(store: RedisStore, scope: Scope, act: Callable[[], object]) -> list[bytes]:
    """What is published on the record's key name while ``act`` runs: read up to a marker
    published after it from the record's own node (so it comes after whatever ``act``
    published there)."""
    channel = store._keys.key(scope)
    pubsub = store.client.pubsub()  # type: ignore[no-untyped-call,unused-ignore]
    try:
        pubsub.subscribe(channel)
        confirmed = pubsub.get_message(timeout=DEADLINE)
        assert confirmed is not None
        assert confirmed["type"] in ("subscribe", b"subscribe")
        act()
        store.client.eval("redis.call('PUBLISH', KEYS[1], 'marker')", 1, channel)
        got: list[bytes] = []
        deadline = time.monotonic() + DEADLINE
        while not got or got[-1] != b"marker":
            assert time.monotonic() < deadline, f"no marker after {got}"
            message = pubsub.get_message(timeout=DEADLINE)
            if message is not None and message["type"] in ("message", b"message"):
                got.append(message["data"])
        return got
    finally:
        pubsub.close()


@pytest.mark.parametrize("before", ["fresh", "marked", "renewed"])
def test_a_settle_publishes_only_where_a_waiter_may_listen(store: RedisStore, before: str) -> None:
    """A fresh reservation's settle publishes nothing; once a waiter marked it, or once it is
    a record on Redis's clock anyway (renewed, as after a takeover), its settle publishes."""
    scope, token = held(store, "k-1")
    if before == "marked":
        assert mark(store, scope) is True
    elif before == "renewed":
        store.renew(scope, token, now=None, lease=LEASE)

    got = published(store, scope, lambda: store.complete(scope, token, b"ok", now=None, ttl=TTL))

    assert got == ([b"marker"] if before == "fresh" else [b"", b"marker"])


def test_the_mark_changes_nothing_a_reader_sees(store: RedisStore) -> None:
    """A marked record is the same record (token, fingerprint, times, lease, expiry); its
    holder settles it and a duplicate replays it; marking a settled, released or missing
    record answers that there is nothing to wait for, and changes nothing."""
    scope, token = held(store, "k-1")
    before = store.get(scope)
    assert before is not None
    key = store._keys.key(scope)
    expiry = store.client.pexpiretime(key)

    assert mark(store, scope) is True
    assert mark(store, scope) is True  # a second waiter: already marked

    assert store.get(scope) == before
    assert store.client.pexpiretime(key) == expiry
    assert store.client.getrange(key, 0, 1) == b"ir"  # in progress, on Redis's clock
    store.complete(scope, token, b"ok", now=None, ttl=TTL)
    replay = store.reserve(scope, "fp", now=None, lease=LEASE, ttl=TTL)
    assert isinstance(replay, Replay)
    assert replay.record.response == b"ok"
    assert replay.record.created_at == before.created_at
    settled = store.client.get(key)

    assert mark(store, scope) is False
    assert store.client.get(key) == settled
    released, released_token = held(store, "k-2")
    store.release(released, released_token)
    assert mark(store, released) is False
    assert mark(store, Scope.of("never", operation="charge", principal="alice")) is False


def race(store: RedisStore, waiter: RedisStore, rounds: int) -> None:
    """``rounds`` times: a fresh reservation, then its settle and a waiter on two threads
    meeting in a random order (`test_wake.meet`); the waiter always returns, and the record
    is settled."""
    rng = random.Random(15)
    with ThreadPoolExecutor(2) as pool:
        for n in range(rounds):
            scope, token = held(store, f"race-{n}")
            settle = functools.partial(store.complete, scope, token, b"done", now=None, ttl=TTL)
            meet(pool, rng, settle, functools.partial(waiter.wait_settled, scope, 2 * DEADLINE))
            record = store.get(scope)
            assert record is not None
            assert record.status is Status.COMPLETED


def test_a_settle_racing_a_waiters_arrival_never_leaves_it_waiting(redis_at: Any) -> None:
    """Many rounds, the settle and the waiter on stores of their own (two processes, as far
    as Redis can tell) arriving in a random order: the waiter always returns, long before
    its wait ends."""
    url, prefix = redis_at
    store, waiter = RedisStore(url, prefix=prefix), RedisStore(url, prefix=prefix)
    try:
        race(store, waiter, rounds=150)
    finally:
        store.close()
        waiter.close()


@pytest.mark.anyio
async def test_an_async_waiter_racing_a_settle_never_waits_on(
    async_redis_store: AsyncRedisStore, redis_url: str, redis_prefix: str
) -> None:
    """The async face's wait, against a sync settle on a thread, in a random order, many
    times: every wait returns. (The settle's pause is the longer: a waiter's subscription
    and mark take two round trips.)"""
    settling = RedisStore(redis_url, prefix=redis_prefix)
    rng = random.Random(7)
    try:
        for n in range(60):
            scope, token = held(settling, f"async-race-{n}")
            pause = rng.random() * 0.005

            def settle(scope: Scope = scope, token: int = token, pause: float = pause) -> None:
                time.sleep(pause)
                settling.complete(scope, token, b"done", now=None, ttl=TTL)

            settled = asyncio.create_task(asyncio.to_thread(settle))
            await asyncio.sleep(rng.random() * 0.002)
            await asyncio.wait_for(
                async_redis_store.wait_settled(scope, seconds=2 * DEADLINE), DEADLINE
            )
            await asyncio.wait_for(settled, DEADLINE)
    finally:
        settling.close()


def previous_settle(store: RedisStore) -> Any:
    """The previous version's settle script, as its processes run it (tests/redis_previous_
    settle: it takes the token, state, response, now, ttl and grace, and always publishes)."""
    names = ("common.lua", "settle.lua")
    text = "".join((PREVIOUS / name).read_text(encoding="utf-8") for name in names)
    return store.client.register_script(text)


def test_a_previous_version_settles_a_marked_record_and_wakes_the_waiter(
    store: RedisStore,
) -> None:
    """During a rolling upgrade the holder may be a process of the previous version: its
    settle of a record this version's waiter marked publishes (it always did), and the
    record replays here with its times on Redis's clock."""
    scope, token = held(store, "k-1")
    before = store.get(scope)
    assert before is not None
    assert mark(store, scope) is True
    settle = previous_settle(store)
    key = store._keys.key(scope)
    args = [token, "c", b"old", "", TTL // timedelta(microseconds=1), store._keys.grace_ms]

    got = published(store, scope, lambda: settle(keys=[key], args=args))

    assert got == [b"", b"marker"]
    replay = store.reserve(scope, "fp", now=None, lease=LEASE, ttl=TTL)
    assert isinstance(replay, Replay)
    assert replay.record.response == b"old"
    assert replay.record.created_at == before.created_at
    assert before.created_at <= replay.record.updated_at


def test_this_versions_settle_takes_a_record_the_previous_version_settled_as_a_repeat(
    store: RedisStore,
) -> None:
    """A settle re-sent by this version after the previous version's settle of the same
    token and response (a process restarted into the new version mid-retry) succeeds
    without a change; another response is fenced."""
    scope, token = held(store, "k-1")
    key = store._keys.key(scope)
    args = [token, "c", b"old", "", TTL // timedelta(microseconds=1), store._keys.grace_ms]
    previous_settle(store)(keys=[key], args=args)
    settled = store.client.get(key)

    store.complete(scope, token, b"old", now=None, ttl=TTL)

    assert store.client.get(key) == settled
    with pytest.raises(FencedError):
        store.complete(scope, token, b"new", now=None, ttl=TTL)
    assert store.client.get(key) == settled
