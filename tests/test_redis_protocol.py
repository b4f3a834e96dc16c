"""The Redis store's own side of the record protocol: tokens that never come back, Redis's
clock, takeovers on it, undecodable records, records of the previous layout and `evict`, on
the machine's server and on the private cluster, through both faces.

Every test drives a `Face`: the async store as it is, the sync one through worker threads, so
one assertion covers both code paths. Raw Redis commands (a DEL as expiry or eviction would do
it, bytes or a hash written by something else) go through the store's own client.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
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
from idempo._core.record import Acquired, InProgress, Mismatch, Replay
from idempo.stores.redis import AsyncRedisStore, RedisStore, _ops
from idempo.stores.redis._protocol import HEADER, reservation

pytestmark = [pytest.mark.redis, pytest.mark.anyio]

LEASE = timedelta(seconds=30)
TTL = timedelta(hours=1)
SHORT = timedelta(seconds=1)
MS = timedelta(milliseconds=1)


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

    async def raw(self, command: str, *args: Any, **options: Any) -> Any:
        """A plain command on the store's client (routed to the key's node on a cluster)."""
        return await self._call(getattr(self.store.client, command), *args, **options)

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
    await face.raw("setrange", face.key(s), 2, ahead.to_bytes(8, "big"))  # the token's bytes

    later = datetime.now(UTC) + LEASE + timedelta(seconds=1)
    assert await acquire(face, s, now=later) == ahead + 1


async def test_a_resent_reserve_gets_its_own_reservation_back(face: Face) -> None:
    """The same reserve command run twice (redis-py re-sending it after a lost reply, as
    both its server and its cluster clients do) acquires once and answers the second time
    with the same token; any other attempt is told the key is in progress. So for the plain
    SET NX of a fresh key, and for the reserve script of a takeover."""
    s = scope()
    flow = _ops.reserve(face.store._keys, s, "fp", None, LEASE, TTL)
    command = next(flow)
    if command.name == "time":  # the store's first call reads Redis's clock
        command = flow.send(await face.raw("time"))
    replies = [await face.raw(command.name, *command.args, **command.options) for _ in range(2)]
    assert replies[0] is None
    with pytest.raises(StopIteration) as again:
        flow.send(replies[1])
    record = await face.get(s)
    assert record is not None
    assert again.value.value == Acquired(token=record.token)
    assert isinstance(await face.reserve(s, "fp", now=None, lease=LEASE, ttl=TTL), InProgress)

    later = datetime.now(UTC) + LEASE + timedelta(seconds=1)  # the lease is over by then
    args = face.store._keys.reserve_args(s, "fp", b"n0nce-42", later, LEASE, TTL)
    script = face.store._scripts["reserve"]
    twice = [await face._call(script, keys=[face.key(s)], args=args) for _ in range(2)]
    first, second = (reservation(reply, s, "fp", later) for reply in twice)
    assert isinstance(first, Acquired)
    assert first.taken_over
    assert first.token > record.token
    assert second == Acquired(token=first.token)
    assert isinstance(await face.reserve(s, "fp", now=later, lease=LEASE, ttl=TTL), InProgress)


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
    # A fresh reservation's times come from its key's expiry, which Redis keeps in ms.
    before = before.replace(microsecond=before.microsecond // 1000 * 1000)
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


@pytest.mark.parametrize("estimate", ["fresh", "stale", "behind"])
@pytest.mark.parametrize("retention", ["kept", "grows"])
async def test_a_fresh_reservation_settled_on_redis_clock_keeps_its_times(
    face: Face, estimate: str, retention: str
) -> None:
    """A fresh reservation's settle (its time the caller's estimate of Redis's clock, or
    Redis's TIME when that estimate is stale) keeps the created time, stamps an updated time
    between the record's last change and Redis's clock after the settle (an estimate far
    behind is clamped to the last change), and ends the retention where the key expires: as
    reserved, or ``ttl`` after the settle when that is later."""
    s = scope()
    token = await acquire(face, s, ttl=TTL if retention == "kept" else SHORT)
    held = await face.get(s)
    assert held is not None
    clock = face.store._keys.clock
    if estimate == "stale":  # read longer ago than it is trusted for
        at = clock.ticks() - 2 * clock.FRESH_FOR
        clock.anchor([b"0", b"0"], at, at)
    elif estimate == "behind":  # a reading of Redis's clock 10 s behind, as a step back gives
        behind = await face.server_now(s) - timedelta(seconds=10)
        at = clock.ticks()
        clock.anchor([str(int(behind.timestamp())).encode(), str(behind.microsecond)], at, at)

    await face.complete(s, token, b"ok", now=None, ttl=TTL)

    after = await face.server_now(s)
    done = await face.get(s)
    assert done is not None
    assert done.created_at == held.created_at
    assert held.updated_at <= done.updated_at <= after
    if estimate == "behind":
        assert done.updated_at == held.updated_at
    assert done.expires_at == max(held.expires_at, done.updated_at + TTL)
    expiry_ms = await face.raw("pexpiretime", face.key(s))
    assert expiry_ms == (done.expires_at - datetime(1970, 1, 1, tzinfo=UTC)) // MS
    replay = await face.reserve(s, "fp", now=None, lease=LEASE, ttl=TTL)
    assert isinstance(replay, Replay)
    assert replay.record == done


# -- undecodable records -------------------------------------------------------------------

# How a record can be broken: bytes overwritten in place (offsets into the fresh record of
# `scope()` with fingerprint "fp": the header's state at 0, clock at 1, fingerprint length at
# 50, point length at 52; the fingerprint at 59, the principal at 61), its expiry taken away,
# or a key that is not one of ours at all. The second element says whether reserve reads the
# broken part (the scope's own strings are only read back by get).
BROKEN: dict[str, tuple[Callable[[str], list[tuple[Any, ...]]], bool]] = {
    "bad-state": (lambda key: [("setrange", key, 0, b"z")], True),
    "bad-clock": (lambda key: [("setrange", key, 1, b"q")], True),
    "strings-past-the-end": (lambda key: [("setrange", key, 50, b"\x7f\xff")], True),
    "bad-point-length": (lambda key: [("setrange", key, 52, b"\x00\x09")], True),
    "bad-fingerprint": (lambda key: [("setrange", key, 59, b"\xff\xfe")], True),
    "bad-principal": (lambda key: [("setrange", key, 61, b"\xff")], False),
    "no-expiry": (lambda key: [("persist", key)], True),
    "too-short": (lambda key: [("set", key, b"i" + bytes(20))], True),
    "foreign-string": (lambda key: [("set", key, "hello")], True),
    "foreign-hash": (lambda key: [("delete", key), ("hset", key, "owner", "someone else")], True),
    "old-layout-without-ea": (
        lambda key: [
            ("delete", key),
            ("hset", key, {"mapping": {**OLD_FIELDS, "st": "completed"}}),
        ],
        True,
    ),
    "a-list": (lambda key: [("delete", key), ("rpush", key, "x")], True),
}
# A record of the previous layout (a hash), its retention end left out.
OLD_FIELDS = {"p": "alice", "o": "charge", "k": "k-1", "fp": "fp", "tok": "5", "le": "1",
              "ca": "1", "ua": "1", "n": "old", "resp": "r"}  # fmt: skip


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
        options = args.pop() if isinstance(args[-1], dict) else {}
        await face.raw(command, *args, **options)

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


# -- records of the previous layout --------------------------------------------------------


async def old_record(face: Face, s: Scope, **fields: Any) -> int:
    """A record as the previous layout kept it (a hash, every time in µs on Redis's clock,
    written by its Lua scripts); its token."""
    now = int((await face.server_now(s)).timestamp() * 1e6)
    hashed = {
        "p": s.principal, "o": s.operation, "k": s.key, "fp": "ab" * 32, "st": "completed",
        "tok": str(now - 5), "le": str(now - 1), "ca": str(now - 10), "ua": str(now - 5),
        "ea": str(now + 3_600_000_000), "n": "0123456789abcdef01", "resp": b"old answer",
    } | fields  # fmt: skip
    await face.raw("hset", face.key(s), mapping=hashed)
    await face.raw("pexpire", face.key(s), 3_660_000)
    return int(hashed["tok"])


async def test_a_record_of_the_previous_layout_is_converted_where_it_is_read(face: Face) -> None:
    """A hash the previous layout wrote is converted in place (one string, its key's expiry at
    the end of its retention) the first time a reserve, get or evict reads it: a completed one
    replays, one whose lease ended is taken over with a larger token, and evict removes one."""
    done, stalled, evicted = scope("done"), scope("stalled"), scope("evicted")
    token = await old_record(face, done)
    verdict = await face.reserve(done, "ab" * 32, now=None, lease=LEASE, ttl=TTL)
    assert isinstance(verdict, Replay)
    assert (verdict.record.token, verdict.record.response) == (token, b"old answer")
    assert await face.raw("type", face.key(done)) == b"string"
    assert 0 < await face.raw("pttl", face.key(done)) <= 3_600_000
    assert await face.get(done) == verdict.record

    old = await old_record(face, stalled, st="in_progress", resp=b"")
    record = await face.get(stalled)
    assert record is not None
    assert (record.status, record.token) == (Status.IN_PROGRESS, old)
    taken = await face.reserve(stalled, "ab" * 32, now=None, lease=LEASE, ttl=TTL)
    assert isinstance(taken, Acquired)
    assert taken.taken_over
    assert taken.token > old

    await old_record(face, evicted)
    assert await face.evict(evicted) is True
    assert await face.get(evicted) is None
    assert await acquire(face, evicted) > 0


# The released version's own scripts (tests/redis_previous_layout/README.md).
PREVIOUS = Path(__file__).parent / "redis_previous_layout"


async def previous_version(face: Face, script: str, s: Scope, *args: str | bytes) -> Any:
    """Run the released version's ``script`` on ``s``'s record, on Redis's clock."""
    text = (PREVIOUS / f"{script}.lua").read_text(encoding="utf-8")
    return await face.raw("eval", text, 1, face.key(s), *args)


async def previous_reserve(face: Face, s: Scope, fingerprint: str, lease: timedelta) -> Any:
    """A reservation as a process of the released version makes it: its reply (a token when
    it acquired the key)."""
    us, grace_ms = timedelta(microseconds=1), 60_000
    args = ["", str(lease // us), str((lease + TTL) // us),
            str((lease + TTL) // timedelta(milliseconds=1) + grace_ms),
            fingerprint, s.principal, s.operation, s.key, os.urandom(8).hex()]  # fmt: skip
    return await previous_version(face, "reserve", s, *args)


async def previous_settle(face: Face, s: Scope, token: int, status: str, response: bytes) -> int:
    """A completion or failure as a process of the released version writes it: 1, or 0 when
    its token no longer holds the record."""
    args = [str(token), status, response, "", str(TTL // timedelta(microseconds=1)), "3660000"]
    return int(await previous_version(face, "settle", s, *args))


async def test_records_the_released_version_wrote_are_served_across_the_upgrade(
    face: Face,
) -> None:
    """Records the released version's own scripts wrote (hashes) are read by this one: a
    completed one replays its response (and is converted to a string), a failed one reads
    back, a reservation whose lease runs answers in progress and stays a hash, so its holder
    (a process of the released version, mid rolling upgrade) can still complete it, which
    this version then replays; one whose lease ended is taken over with a larger token and
    its stalled holder is fenced."""
    fp = "ab" * 32
    done, failed, running, stalled = (scope(n) for n in ("done", "failed", "running", "stalled"))
    token = await previous_reserve(face, done, fp, LEASE)
    assert await previous_settle(face, done, token, "completed", b"old answer") == 1
    verdict = await face.reserve(done, fp, now=None, lease=LEASE, ttl=TTL)
    assert isinstance(verdict, Replay)
    assert (verdict.record.token, verdict.record.response) == (token, b"old answer")
    assert await face.raw("type", face.key(done)) == b"string"
    assert isinstance(await face.reserve(done, "cd" * 32, now=None, lease=LEASE, ttl=TTL), Mismatch)
    # A process of the released version that meets the converted record fails closed (its
    # store raises CorruptRecordError on this reply): it neither runs nor replays.
    assert (await previous_reserve(face, done, fp, LEASE))[0] == 2

    token = await previous_reserve(face, failed, fp, LEASE)
    assert await previous_settle(face, failed, token, "failed", b"") == 1
    record = await face.get(failed)
    assert record is not None
    assert (record.status, record.token, record.response) == (Status.FAILED, token, b"")

    token = await previous_reserve(face, running, fp, LEASE)
    assert isinstance(await face.reserve(running, fp, now=None, lease=LEASE, ttl=TTL), InProgress)
    record = await face.get(running)
    assert record is not None
    assert (record.status, record.token) == (Status.IN_PROGRESS, token)
    assert await face.raw("type", face.key(running)) == b"hash"
    assert await previous_settle(face, running, token, "completed", b"once") == 1
    verdict = await face.reserve(running, fp, now=None, lease=LEASE, ttl=TTL)
    assert isinstance(verdict, Replay)
    assert (verdict.record.token, verdict.record.response) == (token, b"once")

    short = timedelta(milliseconds=50)
    reserved = await face.server_now(stalled)
    old = await previous_reserve(face, stalled, fp, short)
    await anyio.sleep(3 * short.total_seconds())
    assert await face.server_now(stalled) > reserved + short  # its lease ended on Redis's clock
    taken = await face.reserve(stalled, fp, now=None, lease=LEASE, ttl=TTL)
    assert isinstance(taken, Acquired)
    assert taken.taken_over
    assert taken.token > old
    assert await previous_settle(face, stalled, old, "completed", b"zombie") == 0
    await face.complete(stalled, taken.token, b"winner", now=None, ttl=TTL)
    verdict = await face.reserve(stalled, fp, now=None, lease=LEASE, ttl=TTL)
    assert isinstance(verdict, Replay)
    assert verdict.record.response == b"winner"


# -- takeovers on Redis's clock ------------------------------------------------------------


async def test_a_lease_ended_on_redis_clock_is_taken_over_and_the_stale_holder_fenced(
    face: Face,
) -> None:
    """A fresh reservation on Redis's clock (a plain SET whose lease is its key's expiry minus
    the retention) whose lease ends is taken over by the next attempt with a larger token;
    the stale holder then can neither complete, fail, renew nor release, and the new holder's
    answer is what replays."""
    s = scope()
    short = timedelta(milliseconds=300)
    stale = await acquire(face, s, lease=short)
    assert isinstance(await face.reserve(s, "fp", now=None, lease=LEASE, ttl=TTL), InProgress)
    await anyio.sleep(0.5)

    taken = await face.reserve(s, "fp", now=None, lease=LEASE, ttl=TTL)

    assert isinstance(taken, Acquired)
    assert taken.taken_over
    assert taken.token > stale
    for settle in (face.complete, face.fail):
        with pytest.raises(FencedError):
            await settle(s, stale, b"zombie", now=None, ttl=TTL)
    with pytest.raises(FencedError):
        await face.renew(s, stale, now=None, lease=LEASE)
    await face.release(s, stale)
    record = await face.get(s)
    assert record is not None
    assert (record.status, record.token) == (Status.IN_PROGRESS, taken.token)
    await face.complete(s, taken.token, b"winner", now=None, ttl=TTL)
    replay = await face.reserve(s, "fp", now=None, lease=LEASE, ttl=TTL)
    assert isinstance(replay, Replay)
    assert (replay.record.token, replay.record.response) == (taken.token, b"winner")


def _tapped(flow: _ops.Flow, calls: list[_ops.Call]) -> _ops.Flow:
    """``flow``, with each call it makes kept in ``calls``."""
    try:
        call = next(flow)
        while True:
            calls.append(call)
            call = flow.send((yield call))
    except StopIteration as stop:
        return stop.value


def _one(call: _ops.Call) -> _ops.Flow:
    return (yield call)


@pytest.mark.parametrize("clock", ["given", "redis"])
@pytest.mark.parametrize("point", [None, "step-1"])
async def test_a_takeover_undone_by_its_nonce_ends_its_lease_and_keeps_the_steps(
    face: Face, clock: str, point: str | None
) -> None:
    """The undo of a reservation whose caller never heard the answer (its release by the
    nonce it wrote), after it took over an expired attempt: a record with a recovery point
    stays, with its point, its lease ended and the undone holder's token fenced out, so the
    next attempt takes it over at once, past that token, and resumes from the point; a
    record without one is released. The old holder stays fenced either way."""
    s = scope()
    start = None if clock == "redis" else datetime.now(UTC)
    short = timedelta(milliseconds=1)
    stale = await acquire(face, s, now=start, lease=short)
    if point is not None:
        await face.checkpoint(s, stale, point, now=start, lease=short)
    later = None
    if start is None:
        await anyio.sleep(0.05)  # past the lease on Redis's clock (any longer is as good)
    else:
        later = start + timedelta(minutes=1)

    calls: list[_ops.Call] = []
    keys = face.store._keys
    taken = await face._drive(_tapped(_ops.reserve(keys, s, "fp", later, LEASE, TTL), calls))
    assert isinstance(taken, Acquired)
    assert taken.taken_over
    assert taken.recovery_point == point
    # Every call of the reservation is undone by the same release: the reservation's nonce.
    assert len({getattr(call, "reserves", None) for call in calls} - {None}) == 1
    undo = _ops.undo(calls[-1])
    assert undo is not None
    assert await face._drive(_one(undo)) == 1
    assert await face._drive(_one(undo)) == 0  # a repeat finds nothing

    record = await face.get(s)
    if point is None:
        assert record is None
    else:
        assert record is not None
        assert (record.status, record.recovery_point) == (Status.IN_PROGRESS, point)
        assert record.token > taken.token
    for holder in (stale, taken.token):
        for settle in (face.complete, face.fail):
            with pytest.raises(FencedError):
                await settle(s, holder, b"zombie", now=later, ttl=TTL)
        with pytest.raises(FencedError):
            await face.renew(s, holder, now=later, lease=LEASE)
    again = await face.reserve(s, "fp", now=later, lease=LEASE, ttl=TTL)
    assert isinstance(again, Acquired), again
    assert again.token > taken.token
    assert again.recovery_point == point
    await face.complete(s, again.token, b"resumed", now=later, ttl=TTL)
    replay = await face.reserve(s, "fp", now=later, lease=LEASE, ttl=TTL)
    assert isinstance(replay, Replay)
    assert (replay.record.token, replay.record.response) == (again.token, b"resumed")


async def test_a_released_key_keeps_its_token_floor(face: Face) -> None:
    """A release leaves a tombstone with the released token until the record's retention
    ends: get, stats and scan see no record, and the next reservation takes a larger token
    than every earlier one."""
    s = scope()
    first = await acquire(face, s)
    await face.release(s, first)
    assert await face.get(s) is None
    assert await face.stats() == {}
    assert await face.raw("getrange", face.key(s), 0, 0) == b"x"
    again = await acquire(face, s)
    assert again > first
    record = await face.get(s)
    assert record is not None
    assert record.token == again


async def test_header_layout_is_what_the_scripts_read(face: Face) -> None:
    """The header's fields sit where lua/common.lua reads them."""
    s = scope()
    token = await acquire(face, s)
    value = await face.raw("get", face.key(s))
    state, clock, stored, *_ = HEADER.unpack_from(value)
    assert (state, clock, stored) == (b"i", b"d", token)
