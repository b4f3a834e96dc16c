"""Each store verb as a generator that yields the Redis calls it needs and receives their
replies: the logic written once, for both faces (`_sync.RedisStore`, `_async.AsyncRedisStore`)
to drive, each with its own client.

    flow = reserve(keys, scope, "fp", now=None, lease=LEASE, ttl=TTL)
    call = next(flow)                   # Run(script="reserve", key=..., args=[...])
    flow.send(client_runs(call))        # StopIteration(Acquired(token=...))

The hot verbs (reserve, complete or fail, release, renew) are one call each, one round trip.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from ..._core.keys import Scope
from ..._core.record import Record, Reservation, Status
from .._scan import ScanFilter, oldest
from . import _protocol
from ._protocol import Keys
from ._scripts import PURGE, RELEASE, RENEW, RESERVE, SETTLE

# Keys per SCAN page.
_SCAN_COUNT = 500


# Not frozen: made on every call, never changed (a frozen dataclass's __init__ costs more).
@dataclass(slots=True)
class Run:
    """Run the Lua script named ``script`` on the record at ``key`` with ``args``.

    ``scope`` names the record in errors.
    """

    script: str
    key: str
    args: list[str | bytes]
    scope: Scope | None = None


@dataclass(slots=True)
class Command:
    """A plain command of the client: ``client.<name>(*args, **options)``."""

    name: str
    args: tuple[Any, ...]
    options: dict[str, Any] = field(default_factory=dict)
    scope: Scope | None = None


@dataclass(slots=True)
class Batch:
    """Several runs or commands sent together (a pipeline, no transaction); the replies in
    order. With ``raise_on_error`` off, a command's error is its reply."""

    calls: list[Run | Command]
    raise_on_error: bool = True
    scope: Scope | None = None


@dataclass(slots=True)
class Primaries:
    """A cluster's primary nodes, as the client knows them (no round trip)."""

    scope: Scope | None = None


Call = Run | Command | Batch | Primaries
Flow = Generator[Call, Any, Any]


def reserve(
    keys: Keys,
    scope: Scope,
    fingerprint: str,
    now: datetime | None,
    lease: timedelta,
    ttl: timedelta,
) -> Generator[Call, Any, Reservation]:
    args = keys.reserve_args(scope, fingerprint, now, lease, ttl)
    reply = yield Run(RESERVE, keys.key(scope), args, scope)
    return _protocol.reservation(reply, scope, fingerprint, now)


def undo(call: Call) -> Run | None:
    """What deletes whatever ``call`` may have done, for a caller that never heard its reply
    (cancelled, or the connection failed): a reservation, found by its nonce; None for a
    call that leaves nothing to undo (a settle or a renewal is fenced, a release repeatable).
    """
    if isinstance(call, Run) and call.script == RESERVE:
        return Run(RELEASE, call.key, _protocol.undo_args(call.args), call.scope)
    return None


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
    done = yield Run(SETTLE, keys.key(scope), args, scope)
    _protocol.fenced(done, scope, token)


def renew(
    keys: Keys, scope: Scope, token: int, now: datetime | None, lease: timedelta
) -> Generator[Call, Any, None]:
    done = yield Run(RENEW, keys.key(scope), keys.renew_args(token, now, lease), scope)
    _protocol.fenced(done, scope, token)


def checkpoint(
    keys: Keys, scope: Scope, token: int, point: str | None, now: datetime | None, lease: timedelta
) -> Generator[Call, Any, None]:
    args = keys.renew_args(token, now, lease)
    if point is not None:  # else a renewal: the stored point stays
        args.insert(-1, point.encode())  # before the grace, which renew.lua reads last
    done = yield Run(RENEW, keys.key(scope), args, scope)
    _protocol.fenced(done, scope, token)


def release(keys: Keys, scope: Scope, token: int) -> Generator[Call, Any, None]:
    yield Run(RELEASE, keys.key(scope), _protocol.release_args(token), scope)


def get(keys: Keys, scope: Scope) -> Generator[Call, Any, Record | None]:
    fields = yield Command("hgetall", (keys.key(scope),), scope=scope)
    return _protocol.stored_record(fields, scope)


def evict(keys: Keys, scope: Scope) -> Generator[Call, Any, bool]:
    return bool((yield Command("delete", (keys.key(scope),), scope=scope)))


def purge(
    keys: Keys, before: datetime | None, limit: int, cluster: bool
) -> Generator[Call, Any, int]:
    """Delete up to ``limit`` records whose retention (and any lease) ended by ``before``."""
    purged = 0
    args: list[str | bytes] = [_protocol.micros(before)]

    def visit(found: list[Any]) -> Generator[Call, Any, bool]:
        nonlocal purged
        start = 0
        while start < len(found) and purged < limit:
            chunk = found[start : start + limit - purged]
            start += len(chunk)
            runs: list[Run | Command] = [Run(PURGE, key, args) for key in chunk]
            if cluster:
                # Cluster pipelines refuse scripts: one call per key, routed to its slot's node.
                done = []
                for run in runs:
                    done.append((yield run))
            else:
                done = yield Batch(runs)
            purged += sum(int(n) for n in done)
        return purged >= limit

    yield from _walk(keys, cluster, visit)
    return purged


def stats(keys: Keys, cluster: bool) -> Generator[Call, Any, dict[str, int]]:
    """How many records are in each state."""
    counts: dict[str, int] = {}

    def visit(found: list[Any]) -> Generator[Call, Any, bool]:
        reads: list[Run | Command] = [Command("hget", (key, "st")) for key in found]
        _protocol.count((yield Batch(reads, raise_on_error=False)), counts)
        return False

    yield from _walk(keys, cluster, visit)
    return counts


def scan(keys: Keys, where: ScanFilter, cluster: bool) -> Generator[Call, Any, list[Record]]:
    """Up to ``where.limit`` records that pass ``where``, without their responses: a SCAN
    over the prefix that stops once it found enough, the small fields of each page's hashes
    read in one pipeline. SCAN has no order: the records found are sorted oldest first."""
    found: list[Record] = []

    def visit(page: list[Any]) -> Generator[Call, Any, bool]:
        reads: list[Run | Command] = [
            Command("hmget", (key, *_protocol.LISTED_FIELDS)) for key in page
        ]
        for reply in (yield Batch(reads, raise_on_error=False)):
            record = _protocol.listed_record(reply)
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
