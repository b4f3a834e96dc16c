"""Races on the Redis store's own verbs: duplicates of a fresh key on its plain ``SET NX``,
and takeovers of a lease that ended, released together by a barrier from many threads and
from spawned processes, on the machine's server and on the private cluster.

Every winner appends its token to a Redis list of the key (an effect visible across
processes) and completes with it, so "exactly once" is checked on what really happened: one
winner per key, one effect, and every other caller either told the key is in progress or
given the winner's answer. The guard's own races (through `Idempotency`) are in
tests/test_redis.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from idempo import Scope
from idempo._core.record import Acquired, InProgress, Replay
from idempo.stores.redis import RedisStore
from test_races import (
    BARRIER_TIMEOUT,
    PROCESSES,
    THREADS,
    Call,
    Outcome,
    check_exactly_once,
    make_keys,
    race_threads,
    report_outcomes,
    run_processes,
)
from test_redis import Effects

pytestmark = [pytest.mark.redis, pytest.mark.slow]

LEASE = timedelta(minutes=5)  # no winner's lease ends during a race
TTL = timedelta(hours=1)
ENDED = timedelta(milliseconds=200)  # the seeded leases, over before the race starts
T0 = datetime.now(UTC).replace(microsecond=0) - timedelta(days=1)
T1 = T0 + timedelta(minutes=1)  # the seeded records' retention is over
PURGED_PER_KEY = 3  # the purging process deletes ahead of the reservations, not all at once


def scope(key: str) -> Scope:
    return Scope.of(key, operation="race", principal="alice")


def attempt(
    store: RedisStore, effects: Effects, key: str, now: datetime | None, taken_over: bool
) -> Outcome:
    """One reservation of ``key``: a winner records its effect and completes."""
    try:
        reservation = store.reserve(scope(key), "fp", now=now, lease=LEASE, ttl=TTL)
        if isinstance(reservation, Acquired):
            assert reservation.taken_over == taken_over, reservation
            token = str(reservation.token)
            store.client.rpush(effects.key(key), token)
            store.complete(scope(key), reservation.token, token.encode(), now=now, ttl=TTL)
            return Outcome("executed", key, {"nonce": token})
        if isinstance(reservation, Replay):
            assert reservation.record.response is not None
            return Outcome("replayed", key, {"nonce": reservation.record.response.decode()})
        assert isinstance(reservation, InProgress), reservation
        return Outcome("in_progress", key)
    except Exception as exc:
        return Outcome("error", key, repr(exc))


def reserve_each(
    store: RedisStore, keys: list[str], now: datetime | None, lease: timedelta, ttl: timedelta
) -> dict[str, int]:
    """A reservation per key, held; their tokens."""
    tokens = {}
    for key in keys:
        reservation = store.reserve(scope(key), "fp", now=now, lease=lease, ttl=ttl)
        assert isinstance(reservation, Acquired), reservation
        tokens[key] = reservation.token
    return tokens


def seed(store: RedisStore, keys: list[str], clock: str) -> tuple[dict[str, int], datetime | None]:
    """An abandoned reservation per key whose lease has ended; their tokens, and the ``now``
    the race runs at (Redis's clock, or a given one past the seeded leases)."""
    given = T0 if clock == "given" else None
    tokens = reserve_each(store, keys, given, ENDED, TTL)
    if given is None:
        time.sleep(2 * ENDED.total_seconds())
        return tokens, None
    return tokens, T1


def check_takeovers(store: RedisStore, seeded: dict[str, int], winners: list[Outcome]) -> None:
    for outcome in winners:
        if outcome.kind == "executed":
            assert int(outcome.result["nonce"]) > seeded[outcome.key]
    for key, token in seeded.items():
        record = store.get(scope(key))
        assert record is not None
        assert record.token > token


@pytest.mark.parametrize(
    ("race", "clock"),
    [("fresh", "redis"), ("fresh", "given"), ("takeover", "redis"), ("takeover", "given")],
)
def test_threads_race_reservations(redis_at: tuple[str, str], race: str, clock: str) -> None:
    """32 threads released together at each of 200 keys: fresh keys (one plain SET NX each)
    or keys whose lease ended (the reserve script's takeover), on Redis's clock or a given
    one: one winner per key, with a takeover's token past the old holder's."""
    url, prefix = redis_at
    store = RedisStore(url, prefix=prefix)
    effects = Effects(url, prefix)
    keys = make_keys(f"{race}-{clock}")
    try:
        seeded, now = ({}, None if clock == "redis" else T0)
        if race == "takeover":
            seeded, now = seed(store, keys, clock)

        @contextmanager
        def caller(worker: str) -> Iterator[Call]:
            yield lambda key: attempt(store, effects, key, now, race == "takeover")

        outcomes = race_threads(THREADS, keys, caller)
        check_exactly_once(outcomes, keys, THREADS, effects.collect(keys))
        if race == "takeover":
            check_takeovers(store, seeded, outcomes)
    finally:
        store.close()


def _process_main(
    url: str,
    prefix: str,
    race: str,
    now: datetime | None,
    seeded: dict[str, int],
    index: int,
    keys: list[str],
    barrier: Any,
    results: Any,
) -> None:
    """A spawned process: its own RedisStore, one reservation per key at the barrier; in the
    purge race the first process purges a few expired records first, in the release race it
    releases the key's seeded reservation first, while the others reserve."""

    def run(outcomes: list[Outcome]) -> None:
        store = RedisStore(url, prefix=prefix)
        try:
            effects = Effects(url, prefix)
            for key in keys:
                barrier.wait(timeout=BARRIER_TIMEOUT)
                if race == "purge" and index == 0:
                    store.purge(before=now, limit=PURGED_PER_KEY)
                if race == "release" and index == 0:
                    store.release(scope(key), seeded[key])
                outcomes.append(attempt(store, effects, key, now, race == "takeover"))
        finally:
            store.close()

    report_outcomes(index, barrier, results, run)


def seed_expired(store: RedisStore, keys: list[str]) -> dict[str, int]:
    """A record per key completed at T0 on a given clock, its retention over by T1: what
    the purge race deletes or reserves again. Their tokens."""
    tokens = reserve_each(store, keys, T0, ENDED, ENDED)
    for key, token in tokens.items():
        store.complete(scope(key), token, b"old", now=T0, ttl=ENDED)
    return tokens


@pytest.mark.parametrize("race", ["fresh", "takeover", "purge", "release"])
def test_processes_race_reservations(redis_at: tuple[str, str], race: str) -> None:
    """4 spawned processes, each with its own store (and its own estimate of Redis's clock
    for its tokens), released together at each of 200 keys: one winner per key. In the purge
    race the keys hold records whose retention ended, which one process purges (from the
    ``expiring`` set, a few per key) while the others reserve them: a reservation then is a
    plain SET NX on a key purge just deleted, or the reserve script on a record purge has not
    reached yet, and purge never deletes a winner's record, whose token is past the expired
    one's. In the release race each key holds a live reservation, which one process releases
    (leaving a tombstone with its token) while the others reserve: a reservation before the
    release is told the key is in progress, the first after it takes the tombstone over with
    a larger token."""
    url, prefix = redis_at
    keys = make_keys(f"proc-{race}")
    seeded: dict[str, int] = {}
    now = T1 if race == "purge" else None
    store = RedisStore(url, prefix=prefix)
    try:
        if race == "takeover":
            seeded, _ = seed(store, keys, "redis")
        elif race == "purge":
            seeded = seed_expired(store, keys)
        elif race == "release":
            seeded = reserve_each(store, keys, None, LEASE, TTL)  # live, on Redis's clock
        outcomes = run_processes(_process_main, (url, prefix, race, now, seeded), keys)
        check_exactly_once(outcomes, keys, PROCESSES, Effects(url, prefix).collect(keys))
        if seeded:
            check_takeovers(store, seeded, outcomes)
        if race == "purge":
            assert store.purge(before=T1) == 0  # every record left is a winner's, live
            for outcome in outcomes:
                if outcome.kind == "executed":
                    record = store.get(scope(outcome.key))
                    assert record is not None
                    assert record.response == outcome.result["nonce"].encode()
    finally:
        store.close()
