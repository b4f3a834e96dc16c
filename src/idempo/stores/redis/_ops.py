"""Each store verb as a generator that yields the Redis calls it needs and receives their
replies: the logic written once, for both faces (`_sync.RedisStore`, `_async.AsyncRedisStore`)
to drive, each with its own client.

    flow = reserve(keys, scope, "fp", now=None, lease=LEASE, ttl=TTL)
    call = next(flow)                   # Command("set", (key, record), nx, get, px)
    flow.send(None)                     # StopIteration(Acquired(token=...)): created

The hot verbs are one call each: a fresh reservation and a replay one plain ``SET NX GET``,
a settle, a release, a renewal one script. A reservation whose ``SET`` finds a record it
cannot judge without Redis's clock (in progress, released, on another clock) runs the reserve
script next. A record on a clock the caller gave is also listed in ``<prefix>:expiring`` (one
more pipeline after the write), which `purge` reads instead of scanning the keyspace.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from random import getrandbits
from typing import Any

from ..._core.keys import Scope
from ..._core.record import Acquired, Record, Reservation, Status
from ...errors import StoreError
from .._scan import ScanFilter, oldest
from . import _protocol
from ._protocol import Keys
from ._scripts import EVICT, MARK, PURGE, RELEASE, RENEW, RESERVE, SETTLE, UPGRADE

# Keys per SCAN page.
_SCAN_COUNT = 500
# The records purge reads from `expiring` at a time, and gives one script at a time: a
# script holds Redis's one thread, so a small batch keeps the other clients' waits short
# (pages of 256 and scripts of 32 put live calls' p99 during a purge at 1.4-2.6x that of
# its pauses; 64 and 16 at 1.1-1.2x, for 0.75-0.9x the records/s: benchmarks.md).
_PURGE_READ = 64
_PURGE_BATCH = 16
# Reads of a record whose times derive from its key's expiry, while it keeps changing.
_READS = 5
_SET_GET = {"get": True}


# Not frozen: made on every call, never changed (a frozen dataclass's __init__ costs more).
@dataclass(slots=True)
class Run:
    """Run the Lua script named ``script`` on the records at ``keys`` with ``args``.

    ``scope`` names the record in errors; ``reserves``: the key and nonce of the reservation
    the call may make, which `undo` releases for a caller that never heard its reply.
    """

    script: str
    keys: list[str]
    args: list[str | bytes | int]
    scope: Scope | None = None
    reserves: tuple[str, bytes] | None = None


@dataclass(slots=True)
class Command:
    """A plain command of the client: ``client.<name>(*args, **options)``.

    ``errors``: a WRONGTYPE error (a key of another type) is the reply instead of raised;
    ``reserves``: as `Run`'s.
    """

    name: str
    args: tuple[Any, ...]
    options: dict[str, Any] = field(default_factory=dict)
    scope: Scope | None = None
    errors: bool = False
    reserves: tuple[str, bytes] | None = None


@dataclass(slots=True)
class Batch:
    """Several runs or commands sent together (a pipeline, no transaction); the replies in
    order. With ``raise_on_error`` off, a command's error is its reply. ``reserves``: the
    reservation taken just before (a listing in ``expiring``), which `undo` releases for a
    caller that never heard the reply."""

    calls: list[Run | Command]
    raise_on_error: bool = True
    scope: Scope | None = None
    reserves: tuple[str, bytes] | None = None


@dataclass(slots=True)
class Primaries:
    """A cluster's primary nodes, as the client knows them (no round trip)."""

    scope: Scope | None = None


Call = Run | Command | Batch | Primaries
Flow = Generator[Call, Any, Any]


@dataclass
class Place:
    """Where a purge's sweep of the keyspace stopped (a cutoff ahead of Redis's clock): the
    next purge of the store goes on from there."""

    node: int = 0
    cursor: int = 0
    left: list[Any] = field(default_factory=list)


def reserve(
    keys: Keys,
    scope: Scope,
    fingerprint: str,
    now: datetime | None,
    lease: timedelta,
    ttl: timedelta,
) -> Generator[Call, Any, Reservation]:
    clock = keys.clock
    token = clock.token()
    if token is None:  # the estimate of Redis's clock is stale
        sent = clock.ticks()
        reply = yield Command("time", ())
        clock.anchor(reply, sent, clock.ticks())
        token = clock.token()
        assert token is not None
    # Unique, not secret (it tells this reservation from another's): drawn from the random
    # module, which reseeds in a forked child, with no system call as os.urandom makes.
    nonce = getrandbits(64).to_bytes(8, "big")
    names = _protocol.named(keys.prefix, scope)
    key = names[0]
    value, px = keys.fresh(names, fingerprint, token, nonce, now, lease, ttl)
    # Built only if it is needed (`undo`): most reservations hear their reply.
    reserves = (key, nonce)
    # The command itself, not redis-py's set(): its argument checks cost the hot path more
    # than the rest of a replay's client side. get=True: redis-py's SET reply callback then
    # hands back the value found.
    command = ("SET", key, value, "NX", "GET", "PX", px)
    existing = yield Command("execute_command", command, _SET_GET, scope, True, reserves)
    if existing is None:
        if now is not None:
            yield _expiring(keys, scope, _due(now, lease + ttl), px, reserves)
        return Acquired(token=token)
    if not isinstance(existing, Exception) or not _protocol.wrong_type(existing):
        verdict = _protocol.found(existing, scope, fingerprint, now, nonce)
        if verdict is not None:
            return verdict
    args = keys.reserve_args(scope, fingerprint, nonce, now, lease, ttl)
    reply = yield Run(RESERVE, [key], args, scope, reserves)
    verdict = _protocol.reservation(reply, scope, fingerprint, now)
    if now is not None and isinstance(verdict, Acquired):
        yield _expiring(keys, scope, _due(now, lease + ttl), px, reserves)
    return verdict


def _due(now: datetime, span: timedelta) -> int:
    return _protocol.us(now + span)


def _expiring(
    keys: Keys, scope: Scope, due: int, px: int, reserves: tuple[str, bytes] | None = None
) -> Batch:
    """List a record on a given clock in ``expiring``, by when it may be purged (µs)."""
    calls: list[Run | Command] = [
        Command(name, args, options)
        for name, args, options in keys.listing(keys.digest(scope), due, px)
    ]
    return Batch(calls, scope=scope, reserves=reserves)


def _listed_until(
    keys: Keys, scope: Scope, until: int, now: datetime | None
) -> Generator[Call, Any, None]:
    """After a write on a given clock that moved the record's end to ``until`` (µs)."""
    if now is not None:
        at = _protocol.us(now)
        yield _expiring(keys, scope, until, math.ceil((until - at) / 1000) + keys.grace_ms)


def undo(call: Call) -> Run | None:
    """What undoes whatever ``call`` may have done, for a caller that never heard its reply
    (cancelled, or the connection failed): a reservation, released by its nonce (after a
    reservation taken, its listing's call undoes it too); None for a call that leaves nothing
    to undo (a settle or a renewal is fenced, a release repeatable).
    """
    reserves = call.reserves if isinstance(call, Run | Command | Batch) else None
    if reserves is None:
        return None
    key, nonce = reserves
    return Run(RELEASE, [key], _protocol.undo_args(nonce), call.scope)


def settle(
    keys: Keys,
    scope: Scope,
    token: int,
    status: Status,
    response: bytes,
    now: datetime | None,
    ttl: timedelta,
) -> Generator[Call, Any, None]:
    args = keys.settle_args(token, status, response, now, ttl)
    done = yield Run(SETTLE, [keys.key(scope)], args, scope)
    until = _protocol.fenced(done, scope, token)
    if until > 1:  # 1: a repeat, which changed nothing
        yield from _listed_until(keys, scope, until, now)


def renew(
    keys: Keys, scope: Scope, token: int, now: datetime | None, lease: timedelta
) -> Generator[Call, Any, None]:
    done = yield Run(RENEW, [keys.key(scope)], keys.renew_args(token, now, lease), scope)
    yield from _listed_until(keys, scope, _protocol.fenced(done, scope, token), now)


def checkpoint(
    keys: Keys, scope: Scope, token: int, point: str | None, now: datetime | None, lease: timedelta
) -> Generator[Call, Any, None]:
    args = keys.renew_args(token, now, lease)
    if point is not None:  # else a renewal: the stored point stays
        args.append(point.encode())
    done = yield Run(RENEW, [keys.key(scope)], args, scope)
    yield from _listed_until(keys, scope, _protocol.fenced(done, scope, token), now)


def release(keys: Keys, scope: Scope, token: int) -> Generator[Call, Any, None]:
    yield Run(RELEASE, [keys.key(scope)], _protocol.release_args(token), scope)


def get(keys: Keys, scope: Scope) -> Generator[Call, Any, Record | None]:
    """The record, with the scope stored in it. A record whose times derive from its key's
    expiry is read again with that expiry, until both reads agree."""
    key = keys.key(scope)
    value = yield Command("get", (key,), scope=scope, errors=True)
    for _ in range(_READS):
        if _protocol.wrong_type(value):  # the previous layout's hash: converted in place
            value = _protocol.upgraded((yield Run(UPGRADE, [key], [], scope)), scope)
        if value is None:
            return None
        if not isinstance(value, bytes):
            raise StoreError(f"Redis failed reading a record: {value!r}")
        if not _protocol.derived(value):
            return _protocol.decode(value, scope, own_scope=True).record
        reads: list[Run | Command] = [Command("pexpiretime", (key,)), Command("get", (key,))]
        expiry, again = yield Batch(reads, raise_on_error=False, scope=scope)
        if again == value:
            return _protocol.decode(value, scope, expiry, own_scope=True).record
        value = again
    raise StoreError("a Redis record kept changing while it was read")


def mark(keys: Keys, scope: Scope) -> Generator[Call, Any, bool]:
    """For a duplicate subscribed to the record's key name: whether the record is still in
    progress, marked so that its settle publishes (lua/mark.lua)."""
    return bool(int((yield Run(MARK, [keys.key(scope)], [], scope))))


def evict(keys: Keys, scope: Scope) -> Generator[Call, Any, bool]:
    return bool(int((yield Run(EVICT, [keys.key(scope)], [], scope))))


def purge(
    keys: Keys, place: Place, before: datetime | None, limit: int, cluster: bool
) -> Generator[Call, Any, int]:
    """Delete up to ``limit`` records whose retention (and any lease) ended by ``before``.

    A record on Redis's clock is deleted by Redis itself as its retention ends, so what purge
    has to find is the records on a given clock, listed in ``expiring`` by when they may be
    purged: it reads them from the oldest, never scanning. A cutoff ahead of Redis's clock
    also covers records on Redis's clock that expire before it: those a sweep of the
    keyspace finds, which goes on where the store's last one stopped.
    """
    arg = _protocol.micros(before)
    now = _protocol.redis_now((yield Command("time", ())))
    cutoff = now if before is None else _protocol.us(before)
    purged = yield from _purge_listed(keys, arg, cutoff, limit, cluster)
    if cutoff > now and purged < limit:
        purged += yield from _sweep(keys, place, arg, limit - purged, cluster)
    return purged


def _purge_listed(
    keys: Keys, arg: str, cutoff: int, limit: int, cluster: bool
) -> Generator[Call, Any, int]:
    purged = 0
    while purged < limit:
        options = {"start": 0, "num": min(_PURGE_READ, limit - purged)}
        due = yield Command("zrangebyscore", (keys.expiring, "-inf", cutoff), options)
        if not due:
            break
        results: list[int] = []
        for start in range(0, len(due), _PURGE_BATCH):
            chunk = [keys.record_key(d) for d in due[start : start + _PURGE_BATCH]]
            results += yield from _purge_keys(chunk, arg, cluster)
        gone = [d for d, r in zip(due, results, strict=True) if r < 0]
        later = {d: r for d, r in zip(due, results, strict=True) if r >= 0}
        purged += results.count(-1)
        calls: list[Run | Command] = []
        if gone:
            calls.append(Command("zrem", (keys.expiring, *gone)))
        if later:
            calls.append(Command("zadd", (keys.expiring, later), {"gt": True}))
        yield Batch(calls)
        if any(r <= cutoff for r in later.values()):
            break  # a node whose clock is behind the one that gave the cutoff: next time
    return purged


def _purge_keys(names: list[Any], arg: str, cluster: bool) -> Generator[Call, Any, list[int]]:
    """The purge script's answers for ``names``; one script per key on a cluster, where a
    script touches one slot and pipelines refuse scripts."""
    if not cluster:
        return [int(r) for r in (yield Run(PURGE, names, [arg]))]
    out = []
    for name in names:
        (reply,) = yield Run(PURGE, [name], [arg])
        out.append(int(reply))
    return out


def _sweep(
    keys: Keys, place: Place, arg: str, limit: int, cluster: bool
) -> Generator[Call, Any, int]:
    """Purge up to ``limit`` records a SCAN finds, from where the last sweep stopped to the
    end of the keyspace (then the next sweep starts over)."""
    targets: list[dict[str, Any]] = [{}]
    if cluster:
        targets = [{"target_nodes": node} for node in (yield Primaries())]
    purged = 0
    while place.node < len(targets):
        while place.left and purged < limit:
            chunk, place.left = place.left[:_PURGE_BATCH], place.left[_PURGE_BATCH:]
            chunk, rest = chunk[: limit - purged], chunk[limit - purged :]
            place.left = rest + place.left
            purged += (yield from _purge_keys(chunk, arg, cluster)).count(-1)
        if purged >= limit:
            return purged
        if place.cursor == -1:  # this node's scan is over
            place.node, place.cursor = place.node + 1, 0
            continue
        options = {"match": keys.pattern, "count": _SCAN_COUNT, **targets[place.node]}
        cursor, found = _protocol.page((yield Command("scan", (place.cursor,), options)))
        place.cursor, place.left = cursor or -1, found
    place.node, place.cursor = 0, 0
    return purged


def stats(keys: Keys, cluster: bool) -> Generator[Call, Any, dict[str, int]]:
    """How many records are in each state."""
    counts: dict[str, int] = {}

    def visit(found: list[Any]) -> Generator[Call, Any, bool]:
        reads: list[Run | Command] = [Command("getrange", (key, 0, 0)) for key in found]
        _protocol.count((yield Batch(reads, raise_on_error=False)), counts)
        return False

    yield from _walk(keys, cluster, visit)
    return counts


def scan(keys: Keys, where: ScanFilter, cluster: bool) -> Generator[Call, Any, list[Record]]:
    """Up to ``where.limit`` records that pass ``where``, without their responses: a SCAN
    over the prefix that stops once it found enough, each page's values read (up to their
    responses) in one pipeline. SCAN has no order: the records found are sorted oldest
    first."""
    found: list[Record] = []

    def visit(page: list[Any]) -> Generator[Call, Any, bool]:
        reads: list[Run | Command] = []
        for key in page:
            reads += [
                Command("getrange", (key, 0, _protocol.LISTED_BYTES - 1)),
                Command("pexpiretime", (key,)),
            ]
        replies = yield Batch(reads, raise_on_error=False)
        values = replies[0::2]
        long = [n for n, value in enumerate(values) if not _protocol.listed_whole(value)]
        if long:
            wholes = yield Batch([Command("get", (page[n],)) for n in long], raise_on_error=False)
            for n, whole in zip(long, wholes, strict=True):
                values[n] = whole
        for value, expiry in zip(values, replies[1::2], strict=True):
            record = _protocol.listed_record(value, expiry)
            if record is not None and where.matches(record):
                found.append(record)
        return len(found) >= where.limit

    yield from _walk(keys, cluster, visit)
    return oldest(found, where.limit)


def _walk(
    keys: Keys, cluster: bool, visit: Callable[[list[Any]], Generator[Call, Any, bool]]
) -> Generator[Call, Any, None]:
    """SCAN the prefix (on a cluster each primary in turn), handing each page of keys to
    ``visit`` until it answers True (enough)."""
    targets: list[dict[str, Any]] = [{}]
    if cluster:
        targets = [{"target_nodes": node} for node in (yield Primaries())]
    for target in targets:
        cursor = 0
        while True:
            reply = yield Command(
                "scan", (cursor,), {"match": keys.pattern, "count": _SCAN_COUNT, **target}
            )
            cursor, found = _protocol.page(reply)
            if found and (yield from visit(found)):
                return
            if cursor == 0:
                break
