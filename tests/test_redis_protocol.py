"""The Redis store's own side of the record protocol: tokens that never come back, Redis's
clock, undecodable records and `evict`, on the machine's server and on the private cluster,
through both faces.

Every test drives a `Face`: the async store as it is, the sync one through worker threads, so
one assertion covers both code paths. Raw Redis commands (a DEL as expiry or eviction would do
it, a hash written by something else) go through the store's own client.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import anyio.to_thread
import pytest

import idempo.policy
from idempo import (
    CorruptRecordError,
    FencedError,
    Idempotency,
    Policy,
    RequestInProgressError,
    Scope,
    Status,
)
from idempo._core.digest import key_digest
from idempo._core.record import Acquired, InProgress, Replay
from idempo.stores.redis import AsyncRedisStore, RedisStore
from idempo.stores.redis._protocol import reservation

pytestmark = [pytest.mark.redis, pytest.mark.anyio]

LEASE = timedelta(seconds=30)
TTL = timedelta(hours=1)
SHORT = timedelta(seconds=1)


class Face:
    """A Redis store behind awaited verbs: the sync store's verbs run in worker threads."""

    def __init__(self, store: RedisStore | AsyncRedisStore) -> None:
        self.store = store
        self.is_async = isinstance(store, AsyncRedisStore)

    def __getattr__(self, name: str) -> Callable[..., Awaitable[Any]]:
        return functools.partial(self._call, getattr(self.store, name))

    async def _call(self, verb: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self.is_async:
            return await verb(*args, **kwargs)
        return await anyio.to_thread.run_sync(functools.partial(verb, *args, **kwargs))

    async def raw(self, command: str, *args: Any) -> Any:
        """A plain command on the store's client (routed to the key's node on a cluster)."""
        return await self._call(getattr(self.store.client, command), *args)

    def key(self, scope: Scope) -> str:
        return self.store._keys.key(scope)

    async def server_now(self, scope: Scope) -> datetime:
        """Redis's clock, read on the node that holds ``scope``'s record."""
        seconds, micros = await self.raw("eval", "return redis.call('TIME')", 1, self.key(scope))
        return datetime.fromtimestamp(int(seconds), UTC) + timedelta(microseconds=int(micros))


FACES = [
    pytest.param(f"{prefix}{kind}_store", id=f"{name}-{face}")
    for kind, name in (("redis", "server"), ("redis_cluster", "cluster"))
    for prefix, face in (("", "sync"), ("async_", "async"))
]


@pytest.fixture(params=FACES)
def face(request: pytest.FixtureRequest) -> Face:
    """Every Redis store: server and cluster, sync and async."""
    return Face(request.getfixturevalue(request.param))


def scope(key: str = "k-1") -> Scope:
    return Scope.of(key, operation="charge", principal="alice")


async def acquire(face: Face, s: Scope, **options: Any) -> int:
    options = {"now": None, "lease": LEASE, "ttl": TTL} | options
    reservation = await face.reserve(s, "fp", **options)
    assert isinstance(reservation, Acquired), reservation
    return reservation.token


# -- tokens never come back ----------------------------------------------------------------


@pytest.mark.parametrize("deletion", ["expiry", "purge", "evict"])
async def test_tokens_grow_across_the_deletion_of_the_record(face: Face, deletion: str) -> None:
    """A record deleted by Redis itself (a key's TTL, maxmemory eviction: a plain DEL), by
    `purge` or by `evict` leaves no token to reuse: the next reservation's token is larger,
    and the stalled first holder can neither release, complete, fail nor renew it."""
    s = scope()
    if deletion == "purge":
        # Its retention ended long ago on any clock, so purge on Redis's clock takes it.
        gone = datetime.now(UTC) - timedelta(hours=1)
        stale = await acquire(face, s, now=gone, lease=SHORT, ttl=SHORT)
        assert await face.purge(before=None) == 1
    else:
        stale = await acquire(face, s)
        if deletion == "expiry":
            assert await face.raw("delete", face.key(s)) == 1
        else:
            assert await face.evict(s) is True
    assert await face.get(s) is None

    fresh = await acquire(face, s)

    assert fresh > stale
    await face.release(s, stale)
    for settle in (face.complete, face.fail):
        with pytest.raises(FencedError):
            await settle(s, stale, b"zombie", now=None, ttl=TTL)
    with pytest.raises(FencedError):
        await face.renew(s, stale, now=None, lease=LEASE)
    record = await face.get(s)
    assert record is not None
    assert (record.status, record.token, record.response) == (Status.IN_PROGRESS, fresh, None)


async def test_takeover_token_is_one_past_a_token_ahead_of_the_clock(face: Face) -> None:
    """A takeover's token is the old one plus one when that is past Redis's clock (a record
    written while the server's clock ran ahead), so it still fences the old holder."""
    s = scope()
    await acquire(face, s)
    ahead = int((await face.server_now(s)).timestamp() * 1e6) + 10**12
    await face.raw("hset", face.key(s), "tok", str(ahead))

    later = datetime.now(UTC) + LEASE + timedelta(seconds=1)
    assert await acquire(face, s, now=later) == ahead + 1


async def test_a_resent_reserve_gets_its_own_reservation_back(face: Face) -> None:
    """The same reserve command run twice (redis-py re-sending it after a lost reply, as
    both its server and its cluster clients do) acquires once and answers the second time
    with the same token; any other attempt is told the key is in progress."""
    s = scope()
    args = face.store._keys.reserve_args(s, "fp", None, LEASE, TTL)
    replies = [
        await face._call(face.store._scripts["reserve"], keys=[face.key(s)], args=args)
        for _ in range(2)
    ]

    first, second = (reservation(reply, s, "fp", None) for reply in replies)

    assert isinstance(first, Acquired)
    assert second == first
    assert isinstance(await face.reserve(s, "fp", now=None, lease=LEASE, ttl=TTL), InProgress)


async def test_evict_deletes_any_record_once(face: Face) -> None:
    """evict deletes the record whatever its state and says whether one was there."""
    live, done = scope("live"), scope("done")
    await acquire(face, live)
    token = await acquire(face, done)
    await face.complete(done, token, b"ok", now=None, ttl=TTL)

    assert [await face.evict(s) for s in (live, done, live, scope("never"))] == [
        True,
        True,
        False,
        False,
    ]
    assert await face.get(live) is None
    assert await face.get(done) is None


# -- Redis's clock -------------------------------------------------------------------------


async def test_now_none_is_redis_clock_so_a_caller_clock_ahead_cannot_take_over(
    face: Face,
) -> None:
    """With ``now=None`` the lease, the record's times and the in-progress answer are on
    Redis's clock: a caller whose own clock runs a day ahead (which an injected ``now`` would
    stand for) gets "in progress" for the rest of the live lease, not a takeover."""
    s = scope()
    before = await face.server_now(s)
    token = await acquire(face, s)
    after = await face.server_now(s)
    record = await face.get(s)
    assert record is not None
    assert before <= record.created_at == record.updated_at <= after
    assert record.lease_expires_at == record.created_at + LEASE
    assert record.expires_at == record.created_at + LEASE + TTL

    verdict = await face.reserve(s, "fp", now=None, lease=LEASE, ttl=TTL)

    assert isinstance(verdict, InProgress)
    assert 0 < verdict.retry_after <= LEASE.total_seconds()
    assert (
        verdict.retry_after >= (record.lease_expires_at - await face.server_now(s)).total_seconds()
    )
    # An explicit clock wins (tests, simulations): a day ahead, the lease is over.
    ahead = datetime.now(UTC) + timedelta(days=1)
    assert await acquire(face, s, now=ahead) > token


def test_guard_on_redis_clock_refuses_a_host_a_day_ahead(
    redis_at: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the guard with the default policy (no clock: Redis's), a duplicate from a host
    whose clock runs a day ahead is told the key is in progress for the rest of the live
    lease, and the work runs once."""
    url, prefix = redis_at
    store = RedisStore(url, prefix=prefix)
    idem = Idempotency(store, Policy(lease=LEASE))
    runs = 0
    try:
        with idem.once("order-1", operation="charge", payload={"n": 1}) as holder:
            assert not holder.replayed
            runs += 1
            ahead = datetime.now(UTC) + timedelta(days=1)
            monkeypatch.setattr(idempo.policy, "utcnow", lambda: ahead)
            with (
                pytest.raises(RequestInProgressError) as refused,
                idem.once("order-1", operation="charge", payload={"n": 1}),
            ):
                runs += 1  # pragma: no cover (a takeover: the bug)
            holder.result = "charged"
        assert 0 < refused.value.retry_after <= LEASE.total_seconds()
        with idem.once("order-1", operation="charge", payload={"n": 1}) as again:
            assert again.replayed
            assert again.result == "charged"
    finally:
        store.close()
    assert runs == 1


async def test_settle_renew_and_purge_on_redis_clock(face: Face) -> None:
    """complete, renew and purge with no ``now`` judge and stamp on Redis's clock."""
    lease = timedelta(minutes=5)
    s, old = scope("live"), scope("old")
    token = await acquire(face, s, lease=lease, ttl=SHORT)
    start = await face.server_now(s)
    await face.renew(s, token, now=None, lease=lease)
    renewed = await face.get(s)
    assert renewed is not None
    assert renewed.lease_expires_at is not None
    assert start + lease <= renewed.lease_expires_at <= await face.server_now(s) + lease

    await face.complete(s, token, b"ok", now=None, ttl=TTL)
    done = await face.get(s)
    assert done is not None
    assert start <= done.updated_at <= await face.server_now(s)
    assert done.expires_at == done.updated_at + TTL
    verdict = await face.reserve(s, "fp", now=None, lease=lease, ttl=TTL)
    assert isinstance(verdict, Replay)

    await acquire(face, old, now=datetime.now(UTC) - timedelta(hours=2), lease=SHORT, ttl=SHORT)
    assert await face.purge(before=None) == 1
    assert await face.get(old) is None
    assert await face.get(s) == done


# -- undecodable records -------------------------------------------------------------------

# How a record can be broken: fields deleted, fields overwritten, or a key that is not one of
# ours at all. The second element says whether reserve reads the broken part (the scope's
# own fields are only read back by get).
BROKEN: dict[str, tuple[Callable[[str], list[tuple[Any, ...]]], bool]] = {
    **{
        f"no-{field}": ((lambda key, field=field: [("hdel", key, field)]), field not in "pok")
        for field in ("fp", "st", "tok", "le", "ca", "ua", "ea", "p", "o", "k")
    },
    **{
        f"bad-{field}": ((lambda key, f=field, v=value: [("hset", key, f, v)]), True)
        for field, value in (
            ("tok", "seven"),
            ("st", "zombie"),
            ("ea", "tomorrow"),
            ("le", "1e999x"),
            ("ca", "yesterday"),
            ("fp", b"\xff\xfe"),
        )
    },
    "foreign-hash": (lambda key: [("delete", key), ("hset", key, "owner", "someone else")], True),
    "not-a-hash": (lambda key: [("delete", key), ("set", key, "hello")], True),
}


@pytest.mark.parametrize("broken", list(BROKEN))
async def test_undecodable_record_is_a_typed_error_until_evicted(face: Face, broken: str) -> None:
    """A record that cannot be decoded makes reserve and get raise `CorruptRecordError`, which
    says how to evict it, never KeyError or ValueError; settling or renewing it is fenced,
    purge and stats walk past it, and once evicted the key works again."""
    s, bystander = scope(), scope("bystander")
    token = await acquire(face, s)
    await acquire(face, bystander, now=datetime.now(UTC) - timedelta(hours=2), ttl=SHORT)
    breaks, reserve_reads_it = BROKEN[broken]
    for command, *args in breaks(face.key(s)):
        await face.raw(command, *args)

    with pytest.raises(CorruptRecordError, match="evict"):
        await face.get(s)
    if reserve_reads_it:
        with pytest.raises(CorruptRecordError, match="evict") as caught:
            await face.reserve(s, "fp", now=None, lease=LEASE, ttl=TTL)
        assert s.key not in str(caught.value)
        assert key_digest(s.key) in str(caught.value)
    for settle in (face.complete, face.fail):
        with pytest.raises(FencedError):
            await settle(s, token + 1, b"x", now=None, ttl=TTL)
    with pytest.raises(FencedError):
        await face.renew(s, token + 1, now=None, lease=LEASE)
    await face.release(s, token + 1)
    assert await face.purge(before=None) == 1  # the bystander, past its retention
    await face.stats()

    assert await face.evict(s) is True
    assert await acquire(face, s) > 0
