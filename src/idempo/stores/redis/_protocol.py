"""Redis's side of the record protocol, without I/O: key names, script arguments, replies.

Every function here is pure: the operations in `_ops` build their calls with it and decode
what the faces bring back.

Times travel and are stored as integer microseconds since the epoch (Lua numbers are doubles:
exact below 2^53, until the year 2255); ``now`` goes to a script as the caller's clock, or as
'' for Redis's own (TIME, read inside the script). Lease and retention go as durations, which
the scripts add to that ``now``, so every time in a record comes from one clock.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from datetime import UTC, datetime, timedelta
from typing import Any

from ..._core.digest import key_ref
from ..._core.keys import Scope, evict_hint
from ..._core.record import Acquired, Record, Replay, Reservation, Status, judge
from ...errors import ConfigurationError, CorruptRecordError, FencedError, StoreError

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_US = timedelta(microseconds=1)
_MS = timedelta(milliseconds=1)
_STATES = frozenset(status.value for status in Status)

# The nonce's place in the reserve script's ARGV.
_NONCE = 8
# The fields of the reserve script's answers, by position (reserve.lua lists the shapes).
_REPLY_FIELDS = (b"fp", b"st", b"tok", b"le", b"resp", b"ca", b"ua", b"ea", b"rp")
_REPLAY_FIELDS = (b"st", b"tok", b"resp", b"ca", b"ua", b"ea", b"rp")


def micros(moment: datetime | None) -> str:
    """A script's ``now``: the caller's clock in µs, or '' for Redis's."""
    return "" if moment is None else str((moment - _EPOCH) // _US)


def _span(delta: timedelta) -> str:
    return str(delta // _US)


def _time(value: bytes) -> datetime:
    return _EPOCH + timedelta(microseconds=int(value))


def corrupt(scope: Scope, why: object) -> CorruptRecordError:
    return CorruptRecordError(
        f"the Redis record of {key_ref(scope.key)} (operation {scope.operation!r})"
        f" cannot be decoded ({why}); nothing was run or replayed."
        f" To evict it, {evict_hint(scope)} (or call store.evict(scope))"
    )


def stored_record(fields: dict[bytes, bytes], scope: Scope) -> Record | None:
    """The record an HGETALL answered (None for no key); the scope is the one stored in it."""
    if not fields:
        return None
    try:
        stored = Scope(
            principal=fields[b"p"].decode(),
            operation=fields[b"o"].decode(),
            key=fields[b"k"].decode(),
        )
    except (KeyError, UnicodeDecodeError) as exc:
        raise corrupt(scope, f"scope fields: {exc!r}") from exc
    return _fields_record(fields, stored)


def _fields_record(f: dict[bytes, bytes], scope: Scope) -> Record:
    """The record from its fields; `CorruptRecordError` if any is missing or malformed."""
    try:
        status = Status(f[b"st"].decode())
        # A settled record keeps the 'le' of its last lease (see the scripts): it means nothing.
        lease = f.get(b"le") if status is Status.IN_PROGRESS else None
        point = f.get(b"rp")
        record = Record(
            scope=scope,
            fingerprint=f[b"fp"].decode(),
            status=status,
            token=int(f[b"tok"]),
            lease_expires_at=_time(lease) if lease is not None else None,
            response=f.get(b"resp"),
            created_at=_time(f[b"ca"]),
            updated_at=_time(f[b"ua"]),
            expires_at=_time(f[b"ea"]),
            recovery_point=point.decode() if point is not None else None,
        )
    except (KeyError, ValueError, OverflowError) as exc:  # UnicodeDecodeError is a ValueError
        raise corrupt(scope, f"field {exc!r}") from exc
    if record.status is Status.IN_PROGRESS and record.lease_expires_at is None:
        raise corrupt(scope, "an in-progress record without a lease")
    if record.status is not Status.IN_PROGRESS and record.response is None:
        raise corrupt(scope, "a settled record without a response")
    return record


@functools.lru_cache(maxsize=4096)
def _digest(scope: Scope) -> str:
    """The scope's part of its key name. Cached: a fresh call names its key twice (reserve,
    then settle) and a hot replay names the same key again and again."""
    triple = json.dumps([scope.principal, scope.operation, scope.key])
    return hashlib.sha256(triple.encode()).hexdigest()


class Keys:
    """A store's key names and the arguments of its scripts.

    A record lives in one hash at ``<prefix>:{<sha256 hex>}``: user strings never appear in
    key names, and the braces are a Redis Cluster hash tag.

    >>> keys = Keys("payments", timedelta(minutes=1))
    >>> keys.key(Scope("alice", "POST /payments", "k1"))
    'payments:{f9031f130b95e02929ecb748d1f13f9e8abc4f4ebf97172e74769aa71f444399}'
    """

    def __init__(self, prefix: str, expiry_grace: timedelta) -> None:
        if not prefix:
            raise ConfigurationError("a Redis store needs a non-empty key prefix")
        self.prefix = prefix
        self.grace_ms = max(1, expiry_grace // _MS)
        escaped = "".join("\\" + c if c in "*?[]\\" else c for c in prefix)
        self.pattern = escaped + ":{*}"

    def key(self, scope: Scope) -> str:
        return f"{self.prefix}:{{{_digest(scope)}}}"

    def reserve_args(
        self,
        scope: Scope,
        fingerprint: str,
        now: datetime | None,
        lease: timedelta,
        ttl: timedelta,
    ) -> list[str | bytes]:
        return [
            micros(now),
            _span(lease),
            _span(lease + ttl),
            str((lease + ttl) // _MS + self.grace_ms),
            fingerprint,
            scope.principal,
            scope.operation,
            scope.key,
            os.urandom(9).hex(),  # this attempt's nonce
        ]

    def settle_args(
        self, token: int, status: Status, response: bytes, now: datetime | None, ttl: timedelta
    ) -> list[str | bytes]:
        return [
            str(token),
            status.value,
            bytes(response),
            micros(now),
            _span(ttl),
            str(ttl // _MS + self.grace_ms),
        ]

    def renew_args(self, token: int, now: datetime | None, lease: timedelta) -> list[str | bytes]:
        return [str(token), micros(now), _span(lease), str(self.grace_ms)]


def release_args(token: int) -> list[str | bytes]:
    return ["tok", str(token)]


def undo_args(reserve_args: list[str | bytes]) -> list[str | bytes]:
    """The release script's arguments that delete the reservation made with ``reserve_args``
    (by its nonce), if it was made and is still in progress."""
    return ["n", reserve_args[_NONCE]]


def reservation(reply: Any, scope: Scope, fingerprint: str, now: datetime | None) -> Reservation:
    """What the reserve script answered (reserve.lua lists the shapes), judged against the
    ``now`` it decided with: the caller's, or Redis's TIME that the script answers."""
    if isinstance(reply, int):
        return Acquired(token=reply)
    kind = int(reply[0])
    if kind == 1:
        point = reply[2]
        return Acquired(
            token=int(reply[1]),
            recovery_point=point.decode() if isinstance(point, bytes) else None,
            taken_over=len(reply) > 3,
        )
    if kind == 2:
        why = reply[1].decode() if isinstance(reply[1], bytes) else reply[1]
        raise corrupt(scope, why)
    # A missing field comes back as nil (RESP2) or false (RESP3).
    if kind == 3:
        fields = {
            n: v for n, v in zip(_REPLAY_FIELDS, reply[1:], strict=True) if isinstance(v, bytes)
        }
        fields[b"fp"] = fingerprint.encode()
        return Replay(_fields_record(fields, scope))
    fields = {n: v for n, v in zip(_REPLY_FIELDS, reply[2:], strict=True) if isinstance(v, bytes)}
    if now is None:
        now = _EPOCH + timedelta(microseconds=int(reply[1]))
    verdict = judge(_fields_record(fields, scope), fingerprint, now)
    if verdict is None:  # the script takes over whatever judge would
        raise StoreError(f"{key_ref(scope.key)}: the reserve script answered a free record")
    return verdict


def fenced(done: Any, scope: Scope, token: int) -> None:
    """A settle's or renewal's answer: 0 means the token no longer holds the record."""
    if not int(done):
        raise FencedError(f"{key_ref(scope.key)}: token {token} is stale")


# What a listing reads of each hash: everything but the response.
LISTED_FIELDS = (b"p", b"o", b"k", b"fp", b"st", b"tok", b"le", b"ca", b"ua", b"ea", b"rp")


def listed_record(reply: Any) -> Record | None:
    """The record (without its response) from an HMGET of `LISTED_FIELDS`; None for a key
    that holds no record (another type, or a hash without a scope to name it by)."""
    if not isinstance(reply, list) or len(reply) != len(LISTED_FIELDS):
        return None
    fields = {n: v for n, v in zip(LISTED_FIELDS, reply, strict=True) if isinstance(v, bytes)}
    try:
        scope = Scope(fields[b"p"].decode(), fields[b"o"].decode(), fields[b"k"].decode())
    except (KeyError, UnicodeDecodeError):
        return None
    # The response is not read: a placeholder passes the settled-record check, then goes.
    record = _fields_record({**fields, b"resp": b""}, scope)
    return dataclasses.replace(record, response=None)


def page(reply: Any) -> tuple[int, list[Any]]:
    """A SCAN reply as (next cursor, keys); a cluster client answers the cursor as
    ``{node name: cursor}`` for the one node it asked."""
    cursor, keys = reply
    if isinstance(cursor, dict):
        (cursor,) = cursor.values()
    return int(cursor), list(keys)


def count(statuses: list[Any], counts: dict[str, int]) -> None:
    """Add to ``counts`` the records per state from HGET replies; keys holding something
    else are skipped."""
    for status in statuses:
        if isinstance(status, bytes) and status.decode(errors="replace") in _STATES:
            name = status.decode()
            counts[name] = counts.get(name, 0) + 1
