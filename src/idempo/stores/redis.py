"""Redis store: one hash per record, every state transition one Lua script.

    RedisStore("redis://127.0.0.1:6379/0")            # or RedisStore(client=redis.Redis(...))
    AsyncRedisStore("rediss://cache:6380/1", prefix="payments")
    RedisStore("redis+cluster://10.0.0.1:7000,10.0.0.2:7000/0")   # or client=RedisCluster(...)

**Keys.** A record lives in one hash at ``<prefix>:{<sha256 hex>}``, the digest taken over the
scope (principal, operation, key). User strings never appear in key names; they are kept
inside the hash. The braces are a Redis Cluster hash tag, and every script touches that one
key only, so on a cluster each call goes whole to the node that owns the record's slot.

**Cluster.** A ``redis.cluster.RedisCluster`` (``redis.asyncio.cluster.RedisCluster``) client,
or a ``redis+cluster://`` / ``rediss+cluster://`` URL listing one or more seed nodes, runs the
same scripts: redis-py routes each by its key's slot and follows MOVED/ASK redirections.
`purge` and `stats` SCAN every primary in turn. Cluster pipelines refuse scripts, so on a
cluster `purge` runs its script once per key (a round trip each) instead of pipelining.

**Atomicity.** reserve, complete/fail, release and renew are each one Lua script (EVALSHA):
create the record, take over an expired lease or retention, or hand the existing record back
to the caller, who judges it with `judge` against the ``now`` the script decided with. A
replay is one round trip; a fresh call is two (reserve, then settle). Every write after
reservation is fenced on the token. Every script is safe to run twice, since redis-py re-sends
a command whose connection broke (ten times for a client built by hand, once for the
clients this module builds from a URL), so a lost reply may mean a command ran twice: each
reserve carries a fresh nonce, and a re-sent reserve that finds its own reservation gets the
same token back rather than "in progress"; a repeated complete/fail with the same token,
status and response succeeds without a change; a repeated renew extends the lease again; a
repeated release finds nothing, because tokens are never reused. A reserve whose answer the
async store never got (the caller was cancelled, or the connection failed) is undone in the
background by its nonce, so it does not hold the key for a lease with no one to settle it
(unless its command was still on its way and reaches Redis after the undo: then its lease
frees the key); `AsyncRedisStore.aclose` waits for those undos.

**Tokens.** A token is ``max(old token + 1, Redis's TIME in microseconds)``, computed in the
script. A takeover gets a larger one, and so does a record created after the previous one was
deleted (released, purged, expired by its TTL, evicted under maxmemory, `evict`), so a holder
stalled past its lease and the retention holds a token no later holder has, as long as the
server's clock does not step back by more than the time between the two reservations.

**Time.** ``now=None`` (the default policy) means Redis's clock: the scripts read TIME
themselves, so leases, retention, takeovers, `purge` (``before=None``) and the TTLs all use
the one clock of the node that holds the record, and a caller whose own clock is wrong
cannot take over a live lease. Redis 7 replicates a script's effects, not the script, so a
replica stores the primary's times. A datetime ``now`` is a clock the app injected (tests,
simulations) and is used instead; tokens still come from TIME. Times travel and are stored as
integer microseconds since the epoch; lease and retention go to the scripts as durations.

**Retention.** Each write sets the key's TTL with PEXPIRE to ``expires_at - now`` plus a grace
period (``expiry_grace``, default one minute), so Redis deletes records by itself shortly after
their retention ends. `purge` is therefore a safety net rather than a necessity: it walks the
prefix with a bounded SCAN and deletes, with a script per record that re-checks it, up to
``limit`` records whose retention ended by ``before`` (an in-progress record also needs its
lease over), which is what Redis has not expired yet.

**Faults.** Connection errors and timeouts (and, on a cluster, a cluster that is down, has
uncovered slots or cannot be reached at all) raise `StoreUnavailableError` (the guard then runs
nothing); a key that holds something idempo cannot read (a hash another program wrote, a
missing or malformed field, another type) raises `CorruptRecordError` from reserve and get
until it is evicted (settles and renews by any token are fenced, purge and stats walk past
it); any other Redis error raises `StoreError`. Redis is a *leased* store only: the business
writes and the record never commit together, so it has no ``bind``.

`stats` counts records per state with a SCAN over the prefix: fine for tests and the CLI,
not for a hot path on a large keyspace.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import hashlib
import json
import os
import re
from collections.abc import AsyncGenerator, Iterator
from contextlib import aclosing, contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.asyncio.retry
import redis.cluster
import redis.exceptions
import redis.retry
from redis.backoff import NoBackoff

from .._core.keys import Scope
from .._core.record import Acquired, Record, Replay, Reservation, Status, judge
from ..errors import (
    ConfigurationError,
    CorruptRecordError,
    FencedError,
    StoreError,
    StoreUnavailableError,
)
from . import cannot_connect, seconds

__all__ = ["AsyncRedisStore", "RedisStore"]

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_US = timedelta(microseconds=1)
_MS = timedelta(milliseconds=1)
_SCAN_COUNT = 500
_DEFAULT_TIMEOUT = 5.0
_STATES = frozenset(status.value for status in Status)

# Lua numbers are doubles: microsecond timestamps and tokens (~1.8e15, below 2^53 until the
# year 2255) are exact. tostring() would print them in exponent form, so a number a script
# stores goes out through string.format('%d'), and one it answers as a Lua number, which
# Redis sends as an integer reply.
#
# A script's ``now`` argument is the caller's clock in microseconds, or '' for Redis's own
# (TIME, read inside the script: Redis 7 replicates a script's effects, not the script, so a
# replica never re-reads its own clock). Lease and retention arrive as durations and are
# added to that ``now`` here, so every time in a record comes from one clock; a TTL that is a
# plain sum of durations arrives ready-made, in milliseconds.
#
# The scripts run on Redis's one thread, and inside them every redis.call, every field read
# or written, every element answered, every string.format and every tonumber costs the
# server a few thousand instructions, so the hot paths (reserve of a fresh key, reserve of a
# replay, settle) each do only what they need: a fresh key costs an EXISTS, not a read of
# every field; a replay reads the fields a replay answers and no lease; a settled record
# keeps its last 'le' and 'n' (deleting them would be one more call, and a lease means
# nothing once settled).

_COMMON = """
local function us(n) return string.format('%d', n) end
local function clock(given)
  if given ~= '' then return tonumber(given) end
  local t = redis.call('TIME')
  return t[1] * 1000000 + t[2]
end
local function ttl_ms(expires_at, now)
  local ms = math.floor((expires_at - now) / 1000)
  if ms < 0 then ms = 0 end
  return us(ms + ARGV[#ARGV])
end
"""

# KEYS[1] record. ARGV: now, lease, lease + ttl (µs), lease + ttl + grace (ms), fingerprint,
# principal, operation, key, nonce. Answers, for the caller to decode (_Keys.reservation):
#   token                     acquired, an integer reply (the common case, the shortest)
#   {1, token, point}         acquired with a recovery point, or acquired again (the nonce)
#   {3, st, tok, resp, ca, ua, ea, rp}      a replay: a settled record with this fingerprint
#   {0, now, fp, st, tok, le, resp, ca, ua, ea, rp}   a record to judge at ``now``
#   {2, why}                  the key holds nothing idempo can read
# Fields are answered by position, without names or the scope the caller knows (a replay's
# reply is parsed in Python, where every element costs too).
#
# A token is max(old token + 1, Redis's clock in µs): it grows on a takeover, and a record
# created after the last one was deleted (released, purged, expired, evicted) still starts
# past every token the key had, as long as Redis's clock does not step back.
#
# The nonce is the caller's, new for each reserve: redis-py re-sends a command whose
# connection broke, and a re-sent reserve that finds its own reservation gets it back instead
# of reporting the key in progress.
_RESERVE = """
local now
if ARGV[1] == '' then
  local t = redis.call('TIME')
  now = t[1] * 1000000 + t[2]
else
  now = tonumber(ARGV[1])
end
local created = false
local point = false
local old = false
if redis.call('EXISTS', KEYS[1]) == 1 then
  local r = redis.pcall('HMGET', KEYS[1], 'fp', 'st', 'tok', 'resp', 'ca', 'ua', 'ea', 'rp')
  if r.err then return {2, r.err} end
  local st, ea = r[2], tonumber(r[7])
  if not (ea and r[1] and r[3] and (st == 'in_progress' or st == 'completed' or st == 'failed'))
  then
    return {2, 'fields missing or malformed'}
  end
  if ea > now then
    if st ~= 'in_progress' then
      if r[1] == ARGV[5] then return {3, st, r[3], r[4], r[5], r[6], r[7], r[8]} end
      return {0, now, r[1], st, r[3], false, r[4], r[5], r[6], r[7], r[8]}
    end
    local l = redis.call('HMGET', KEYS[1], 'le', 'n')
    local le = tonumber(l[1])
    if not le then return {2, 'an in-progress record without a lease'} end
    if l[2] == ARGV[9] then return {1, r[3], r[8]} end
    if r[1] ~= ARGV[5] or le > now then
      return {0, now, r[1], st, r[3], l[1], r[4], r[5], r[6], r[7], r[8]}
    end
    created = r[5]
    point = r[8]
  end
  old = tonumber(r[3])
  if not old then return {2, 'fields missing or malformed'} end
  redis.call('DEL', KEYS[1])
end
local token = now
if ARGV[1] ~= '' then
  local t = redis.call('TIME')
  token = t[1] * 1000000 + t[2]
end
if old and old >= token then token = old + 1 end
local stamp = ARGV[1]
if stamp == '' then stamp = string.format('%d', now) end
local tok = stamp
if token ~= now then tok = string.format('%d', token) end
redis.call('HSET', KEYS[1], 'p', ARGV[6], 'o', ARGV[7], 'k', ARGV[8], 'fp', ARGV[5],
  'st', 'in_progress', 'tok', tok, 'le', string.format('%d', now + ARGV[2]),
  'ca', created or stamp, 'ua', stamp, 'ea', string.format('%d', now + ARGV[3]), 'n', ARGV[9])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
if point then
  redis.call('HSET', KEYS[1], 'rp', point)
  return {1, tok, point}
end
return token
"""

# KEYS[1] record. ARGV: token, status, response, now, ttl (µs), ttl + grace (ms). Returns 1
# or 0. Settling again with the same token, status and response succeeds without a change:
# that is redis-py re-sending a settle whose reply the connection lost, or the caller
# retrying it.
_SETTLE = """
local r = redis.pcall('HMGET', KEYS[1], 'tok', 'st', 'ea', 'resp')
if r.err or r[1] ~= ARGV[1] then return 0 end
if r[2] ~= 'in_progress' then
  if r[2] == ARGV[2] and r[4] == ARGV[3] then return 1 end
  return 0
end
local expires = tonumber(r[3])
if not expires then return 0 end
local stamp = ARGV[4]
local now
if stamp == '' then
  local t = redis.call('TIME')
  now = t[1] * 1000000 + t[2]
  stamp = string.format('%d', now)
else
  now = tonumber(stamp)
end
local wanted = now + ARGV[5]
-- The key's TTL already ends a grace period after 'ea' (every write of 'ea' sets it), so
-- only a longer retention needs a new one.
if wanted > expires then
  redis.call('HSET', KEYS[1], 'st', ARGV[2], 'resp', ARGV[3], 'ua', stamp,
    'ea', string.format('%d', wanted))
  redis.call('PEXPIRE', KEYS[1], ARGV[6])
else
  redis.call('HSET', KEYS[1], 'st', ARGV[2], 'resp', ARGV[3], 'ua', stamp)
end
return 1
"""

# KEYS[1] record. ARGV: token, now, lease (µs), grace_ms. Returns 1 or 0; a repeat just
# extends the lease again.
_RENEW = (
    _COMMON
    + """
local r = redis.pcall('HMGET', KEYS[1], 'tok', 'st', 'ea')
if r.err or r[1] ~= ARGV[1] or r[2] ~= 'in_progress' then return 0 end
local expires = tonumber(r[3])
if not expires then return 0 end
local now = clock(ARGV[2])
local lease_end = now + ARGV[3]
if lease_end > expires then expires = lease_end end
redis.call('HSET', KEYS[1], 'le', us(lease_end), 'ua', us(now), 'ea', us(expires))
redis.call('PEXPIRE', KEYS[1], ttl_ms(expires, now))
return 1
"""
)

# KEYS[1] record. ARGV: the name of the field to match ('tok' or 'n') and its value. Deletes
# an in-progress record held with that token (release), or reserved with that nonce (the
# abandon of a reserve whose caller gave up before it heard the answer). A repeat finds
# nothing to delete: tokens and nonces are never reused.
_RELEASE = """
local r = redis.pcall('HMGET', KEYS[1], ARGV[1], 'st')
if not r.err and r[1] == ARGV[2] and r[2] == 'in_progress' then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

# KEYS[1] record. ARGV: before ('' for Redis's clock). Deletes it if its retention (and any
# lease) ended by then; a key holding no readable record is left for evict.
_PURGE = (
    _COMMON
    + """
local r = redis.pcall('HMGET', KEYS[1], 'st', 'ea', 'le')
if r.err then return 0 end
local ea = tonumber(r[2])
if not (r[1] and ea) then return 0 end
local before = clock(ARGV[1])
if ea > before then return 0 end
local le = tonumber(r[3])
if r[1] == 'in_progress' and le and le > before then return 0 end
return redis.call('DEL', KEYS[1])
"""
)


def _us(moment: datetime | None) -> str:
    """A script's ``now``: the caller's clock in µs, or '' for Redis's."""
    return "" if moment is None else str((moment - _EPOCH) // _US)


def _span(delta: timedelta) -> str:
    return str(delta // _US)


def _time(value: bytes) -> datetime:
    return _EPOCH + timedelta(microseconds=int(value))


_NONCE = 8  # the nonce's place in the reserve script's ARGV
_REPLY_FIELDS = (b"fp", b"st", b"tok", b"le", b"resp", b"ca", b"ua", b"ea", b"rp")
_REPLAY_FIELDS = (b"st", b"tok", b"resp", b"ca", b"ua", b"ea", b"rp")


def _corrupt(scope: Scope, why: object) -> CorruptRecordError:
    return CorruptRecordError(
        f"the Redis record of key {scope.key!r} (operation {scope.operation!r}, principal"
        f" {scope.principal!r}) cannot be decoded ({why}); nothing was run or replayed. Evict"
        f" it: `idempo evict URL {scope.key} --operation {scope.operation!r} --principal"
        f" {scope.principal!r}` or store.evict(scope)"
    )


def _record(flat: list[bytes], scope: Scope) -> Record:
    f = {flat[i]: flat[i + 1] for i in range(0, len(flat), 2)}
    try:
        stored = Scope(principal=f[b"p"].decode(), operation=f[b"o"].decode(), key=f[b"k"].decode())
    except (KeyError, UnicodeDecodeError) as exc:
        raise _corrupt(scope, f"scope fields: {exc!r}") from exc
    return _fields_record(f, stored)


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
        raise _corrupt(scope, f"field {exc!r}") from exc
    if record.status is Status.IN_PROGRESS and record.lease_expires_at is None:
        raise _corrupt(scope, "an in-progress record without a lease")
    if record.status is not Status.IN_PROGRESS and record.response is None:
        raise _corrupt(scope, "a settled record without a response")
    return record


def _flat(mapping: dict[bytes, bytes]) -> list[bytes]:
    return [item for pair in mapping.items() for item in pair]


# Cannot reach the data right now: a connection or a timeout, a cluster that is down or
# resharding, or a slot no reachable node serves.
_UNREACHABLE = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.TryAgainError,
    redis.exceptions.SlotNotCoveredError,
)


# What the clients built from a URL re-send once (see _from_url): a broken connection.
_RESENT = (redis.exceptions.ConnectionError,)


_CONNECTING = re.compile(r"Error (-?\d+) connecting to (\S+?)\.(?: |$)")
_REFUSED, _UNKNOWN_HOST = {errno.ECONNREFUSED}, {-2, -3, -5}  # EAI_NONAME, EAI_AGAIN, EAI_NODATA


def _unreachable(exc: BaseException) -> StoreUnavailableError:
    """What a connection error or a timeout means, in a few words (the driver's text is the
    error's cause)."""
    if isinstance(exc, redis.exceptions.AuthenticationError):
        return StoreUnavailableError(f"Redis refused the credentials: {exc}")
    if isinstance(exc, redis.exceptions.TimeoutError):
        # Connecting is bounded by socket_connect_timeout, the login's replies (a server
        # that accepts and then says nothing) by socket_timeout.
        return StoreUnavailableError(f"no answer from Redis within its timeout: {exc}")
    if found := _CONNECTING.match(str(exc)):
        code, where = int(found[1]), found[2]
        if code in _REFUSED:
            return cannot_connect("Redis", where, "connection refused")
        if code in _UNKNOWN_HOST:
            return cannot_connect("Redis", where, f"unknown host {where.rsplit(':', 1)[0]!r}")
        return cannot_connect("Redis", where, str(exc)[found.end() :].rstrip("."))
    return StoreUnavailableError(f"Redis connection failed: {exc}")


@contextmanager
def _translated(scope: Scope | None = None) -> Iterator[None]:
    """Redis errors as idempo's: unreachable (fail closed, retry later), a key of ``scope``
    that holds something else than a hash, or a store fault."""
    try:
        yield
    except _UNREACHABLE as exc:
        raise _unreachable(exc) from exc
    except redis.exceptions.RedisClusterException as exc:
        # redis-py's cluster client reports "no seed node answers" as its own exception,
        # with the connection error as the cause; anything else is a misuse or a fault.
        if isinstance(exc.__cause__, _UNREACHABLE):
            raise StoreUnavailableError(f"Redis Cluster is unreachable: {exc}") from exc
        raise StoreError(f"Redis Cluster failed: {exc}") from exc
    except redis.exceptions.ResponseError as exc:
        if scope is not None and str(exc).startswith("WRONGTYPE"):
            raise _corrupt(scope, exc) from exc
        if "DB index is out of range" in str(exc):  # the SELECT of a new connection
            raise StoreUnavailableError(
                f"the Redis database in the URL does not exist ({exc})"
            ) from exc
        raise StoreError(f"Redis failed: {exc}") from exc
    except redis.exceptions.RedisError as exc:
        raise StoreError(f"Redis failed: {exc}") from exc


def _targets(primaries: list[Any]) -> list[dict[str, Any]]:
    """SCAN's keyword arguments for each primary of a cluster."""
    return [{"target_nodes": node} for node in primaries]


def _page(reply: Any) -> tuple[int, list[Any]]:
    """A SCAN reply as (next cursor, keys); a cluster client answers the cursor as
    ``{node name: cursor}`` for the one node it asked."""
    cursor, keys = reply
    if isinstance(cursor, dict):
        (cursor,) = cursor.values()
    return int(cursor), list(keys)


@functools.lru_cache(maxsize=4096)
def _digest(scope: Scope) -> str:
    """The scope's part of its key name. Cached: a fresh call names its key twice (reserve,
    then settle) and a hot replay names the same key again and again."""
    triple = json.dumps([scope.principal, scope.operation, scope.key])
    return hashlib.sha256(triple.encode()).hexdigest()


class _Keys:
    """Key names, script arguments and replies: everything the two faces share."""

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
    ) -> list[str]:
        return [
            _us(now),
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
            _us(now),
            _span(ttl),
            str(ttl // _MS + self.grace_ms),
        ]

    def renew_args(self, token: int, now: datetime | None, lease: timedelta) -> list[str]:
        return [str(token), _us(now), _span(lease), str(self.grace_ms)]

    @staticmethod
    def release_args(token: int) -> list[str]:
        return ["tok", str(token)]

    @staticmethod
    def abandon_args(reserve_args: list[str]) -> list[str]:
        return ["n", reserve_args[_NONCE]]

    @staticmethod
    def reservation(
        reply: Any, scope: Scope, fingerprint: str, now: datetime | None
    ) -> Reservation:
        """What the reserve script answered (its comment lists the shapes), judged against
        the ``now`` it decided with: the caller's, or Redis's TIME that the script answers."""
        if isinstance(reply, int):
            return Acquired(token=reply)
        kind = int(reply[0])
        if kind == 1:
            point = reply[2]
            return Acquired(
                token=int(reply[1]),
                recovery_point=point.decode() if isinstance(point, bytes) else None,
            )
        if kind == 2:
            why = reply[1].decode() if isinstance(reply[1], bytes) else reply[1]
            raise _corrupt(scope, why)
        # A missing field comes back as nil (RESP2) or false (RESP3).
        if kind == 3:
            fields = {
                n: v for n, v in zip(_REPLAY_FIELDS, reply[1:], strict=True) if isinstance(v, bytes)
            }
            fields[b"fp"] = fingerprint.encode()
            return Replay(_fields_record(fields, scope))
        fields = {
            n: v for n, v in zip(_REPLY_FIELDS, reply[2:], strict=True) if isinstance(v, bytes)
        }
        if now is None:
            now = _EPOCH + timedelta(microseconds=int(reply[1]))
        verdict = judge(_fields_record(fields, scope), fingerprint, now)
        if verdict is None:  # the script takes over whatever judge would
            raise StoreError(f"key {scope.key!r}: the reserve script answered a free record")
        return verdict

    @staticmethod
    def fenced(done: Any, scope: Scope, token: int) -> None:
        if not int(done):
            raise FencedError(f"key {scope.key!r}: token {token} is stale")

    @staticmethod
    def count(statuses: list[Any]) -> dict[str, int]:
        """Records per state from HGET replies; keys holding something else are skipped."""
        counts: dict[str, int] = {}
        for status in statuses:
            if isinstance(status, bytes) and status.decode(errors="replace") in _STATES:
                name = status.decode()
                counts[name] = counts.get(name, 0) + 1
        return counts


def _check_client(client: Any) -> None:
    if client.get_encoder().decode_responses:
        raise ConfigurationError("the Redis client must not decode responses (bytes are stored)")


def _client_options(url: str, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """``url`` and redis-py's options, with idempo's ``connect_timeout`` (an option or in the
    URL's query, seconds) as redis-py's ``socket_connect_timeout``, and the defaults."""
    base, _, query = url.partition("?")
    items = [item for item in query.split("&") if item]
    given = [item.partition("=")[2] for item in items if item.startswith("connect_timeout=")]
    if given:
        url = "?".join(
            (base, "&".join(i for i in items if not i.startswith("connect_timeout=")))
        ).rstrip("?")
        options.setdefault("connect_timeout", given[-1])
    if (timeout := options.pop("connect_timeout", None)) is not None:
        options["socket_connect_timeout"] = seconds(timeout)
    options.setdefault("socket_timeout", _DEFAULT_TIMEOUT)
    options.setdefault("socket_connect_timeout", _DEFAULT_TIMEOUT)
    if options.get("decode_responses"):
        raise ConfigurationError("the Redis client must not decode responses (bytes are stored)")
    return url, options


def _cluster_seeds(url: str) -> tuple[str, list[tuple[str, int]]] | None:
    """For a ``redis+cluster://`` URL: the URL redis-py reads (its first seed node) and the
    other seeds, as (host, port); None for a plain ``redis://`` URL."""
    parts = urlsplit(url)
    base, _, kind = parts.scheme.partition("+")
    if not kind:
        return None
    if kind != "cluster" or base not in ("redis", "rediss"):
        raise ConfigurationError(
            f"unknown Redis URL scheme {parts.scheme!r}: use redis, rediss, redis+cluster"
            " or rediss+cluster"
        )
    if parts.path not in ("", "/", "/0"):
        raise ConfigurationError("Redis Cluster has database 0 only")
    userinfo, at, hosts = parts.netloc.rpartition("@")
    seeds: list[tuple[str, int]] = []
    for seed in hosts.split(","):
        try:
            node = urlsplit(f"//{seed}")
            port = node.port or 6379
        except ValueError as exc:
            raise ConfigurationError(f"bad Redis Cluster seed node {seed!r}") from exc
        if not node.hostname:
            raise ConfigurationError(f"bad Redis Cluster seed node {seed!r}")
        seeds.append((node.hostname, port))
    first = hosts.split(",", 1)[0]
    return urlunsplit((base, userinfo + at + first, parts.path, parts.query, "")), seeds[1:]


def _from_url(
    url: str, options: dict[str, Any], single: Any, cluster: Any, node: Any, retry: Any
) -> Any:
    """A client for ``url``: ``single.from_url``, or for a cluster URL ``cluster.from_url``
    with every seed node (``node`` is the ClusterNode class and ``retry`` the Retry class of
    the same face)."""
    url, options = _client_options(url, options)
    seeds = _cluster_seeds(url)
    if seeds is None:
        # One re-send of a command whose connection broke, as a client built by hand does
        # ten times: every script is safe to run twice (the reserve's nonce, fenced and
        # repeatable settles), and a reply lost with the connection then costs nothing. A
        # timeout is not re-sent: a frozen server would make every call wait twice.
        options.setdefault("retry", retry(NoBackoff(), 1, supported_errors=_RESENT))
        return single.from_url(url, **options)
    first, others = seeds
    # The synchronous cluster client connects at once, to learn the slot map.
    with _translated():
        return cluster.from_url(
            first, startup_nodes=[node(host, port) for host, port in others], **options
        )


class RedisStore:
    """A `Store` in Redis (leased mode only), on a client built from ``url`` or the app's own.

    Args:
        url: ``redis://host:port/db`` or ``rediss://...``; for Redis Cluster
            ``redis+cluster://host:port,host:port/0`` (any seed nodes; ``rediss+cluster`` for
            TLS). Extra keyword options go to ``redis.Redis.from_url`` (or
            ``RedisCluster.from_url``); 5 s socket and connect timeouts unless given.
        client: a ``redis.Redis`` or ``redis.cluster.RedisCluster`` the app owns
            (``decode_responses`` off); `close` leaves it open.
        prefix: the first part of every key name, so several apps or tests share a database.
        expiry_grace: how long after a record's retention Redis keeps it before expiring it.

    A cluster URL connects at once (redis-py learns the slot map), so an unreachable cluster
    raises `StoreUnavailableError` here; a plain URL connects on first use.

        store = RedisStore("redis+cluster://10.0.0.1:7000,10.0.0.2:7000/0", prefix="payments")
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        client: redis.Redis | redis.cluster.RedisCluster | None = None,
        prefix: str = "idempo",
        expiry_grace: timedelta = timedelta(minutes=1),
        **options: Any,
    ) -> None:
        if (url is None) == (client is None):
            raise ConfigurationError("give RedisStore a URL or a client, not both")
        if client is None:
            assert url is not None
            client = _from_url(
                url,
                options,
                redis.Redis,
                redis.cluster.RedisCluster,
                redis.cluster.ClusterNode,
                redis.retry.Retry,
            )
            self._owned = True
        else:
            _check_client(client)
            self._owned = False
        self.client: redis.Redis | redis.cluster.RedisCluster = client
        self._keys = _Keys(prefix, expiry_grace)
        self._reserve = client.register_script(_RESERVE)
        self._settle = client.register_script(_SETTLE)
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)
        self._purge = client.register_script(_PURGE)

    def reserve(
        self,
        scope: Scope,
        fingerprint: str,
        *,
        now: datetime | None,
        lease: timedelta,
        ttl: timedelta,
    ) -> Reservation:
        args = self._keys.reserve_args(scope, fingerprint, now, lease, ttl)
        with _translated(scope):
            reply = self._reserve(keys=[self._keys.key(scope)], args=args)
        return self._keys.reservation(reply, scope, fingerprint, now)

    def _settle_as(
        self,
        scope: Scope,
        token: int,
        status: Status,
        response: bytes,
        now: datetime | None,
        ttl: timedelta,
    ) -> None:
        args = self._keys.settle_args(token, status, response, now, ttl)
        with _translated(scope):
            done = self._settle(keys=[self._keys.key(scope)], args=args)
        self._keys.fenced(done, scope, token)

    def complete(
        self, scope: Scope, token: int, response: bytes, *, now: datetime | None, ttl: timedelta
    ) -> None:
        self._settle_as(scope, token, Status.COMPLETED, response, now, ttl)

    def fail(
        self, scope: Scope, token: int, response: bytes, *, now: datetime | None, ttl: timedelta
    ) -> None:
        self._settle_as(scope, token, Status.FAILED, response, now, ttl)

    def release(self, scope: Scope, token: int) -> None:
        with _translated(scope):
            self._release(keys=[self._keys.key(scope)], args=self._keys.release_args(token))

    def renew(self, scope: Scope, token: int, *, now: datetime | None, lease: timedelta) -> None:
        args = self._keys.renew_args(token, now, lease)
        with _translated(scope):
            done = self._renew(keys=[self._keys.key(scope)], args=args)
        self._keys.fenced(done, scope, token)

    def get(self, scope: Scope) -> Record | None:
        with _translated(scope):
            fields: Any = self.client.hgetall(self._keys.key(scope))
        return _record(_flat(fields), scope) if fields else None

    def evict(self, scope: Scope) -> bool:
        with _translated(scope):
            return bool(self.client.delete(self._keys.key(scope)))

    def _scan(self) -> Iterator[list[Any]]:
        """The prefix's keys, a SCAN page at a time (on a cluster, each primary in turn)."""
        targets: list[dict[str, Any]] = [{}]
        if isinstance(self.client, redis.cluster.RedisCluster):
            targets = _targets(self.client.get_primaries())  # type: ignore[no-untyped-call]
        for target in targets:
            cursor = 0
            while True:
                with _translated():
                    reply: Any = self.client.scan(
                        cursor, match=self._keys.pattern, count=_SCAN_COUNT, **target
                    )
                cursor, keys = _page(reply)
                if keys:
                    yield keys
                if cursor == 0:
                    break

    def _purge_each(self, keys: list[Any], before: str) -> int:
        if isinstance(self.client, redis.cluster.RedisCluster):
            # Cluster pipelines refuse scripts: one call per key, routed to its slot's node.
            with _translated():
                return sum(int(self._purge(keys=[key], args=[before])) for key in keys)
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            self._purge(keys=[key], args=[before], client=pipe)
        with _translated():
            return sum(int(done) for done in pipe.execute())

    def purge(self, *, before: datetime | None = None, limit: int = 1000) -> int:
        purged = 0
        for page in self._scan():
            start = 0
            while start < len(page) and purged < limit:
                chunk = page[start : start + limit - purged]
                start += len(chunk)
                purged += self._purge_each(chunk, _us(before))
                if purged >= limit:
                    return purged
        return purged

    def stats(self) -> dict[str, int]:
        """How many records are in each state (a SCAN over the prefix)."""
        counts: dict[str, int] = {}
        for page in self._scan():
            pipe = self.client.pipeline(transaction=False)
            for key in page:
                pipe.hget(key, "st")
            with _translated():
                statuses = pipe.execute(raise_on_error=False)
            for state, n in self._keys.count(statuses).items():
                counts[state] = counts.get(state, 0) + n
        return counts

    def close(self) -> None:
        if self._owned:
            self.client.close()
            if isinstance(self.client, redis.cluster.RedisCluster):
                # A cluster client built from a URL gives each node a pool its close leaves
                # open (redis-py): close them here, or their sockets linger until collected.
                for node in self.client.get_nodes():  # type: ignore[no-untyped-call]
                    if node.redis_connection is not None:
                        node.redis_connection.connection_pool.disconnect()


class AsyncRedisStore:
    """The asynchronous twin of `RedisStore`, on ``redis.asyncio.Redis`` or
    ``redis.asyncio.cluster.RedisCluster`` (which connects on first use).

        store = AsyncRedisStore(client=redis.asyncio.cluster.RedisCluster(host="10.0.0.1"))
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        client: redis.asyncio.Redis | redis.asyncio.cluster.RedisCluster | None = None,
        prefix: str = "idempo",
        expiry_grace: timedelta = timedelta(minutes=1),
        **options: Any,
    ) -> None:
        if (url is None) == (client is None):
            raise ConfigurationError("give AsyncRedisStore a URL or a client, not both")
        if client is None:
            assert url is not None
            client = _from_url(
                url,
                options,
                redis.asyncio.Redis,
                redis.asyncio.cluster.RedisCluster,
                redis.asyncio.cluster.ClusterNode,
                redis.asyncio.retry.Retry,
            )
            self._owned = True
        else:
            _check_client(client)
            self._owned = False
        self.client: redis.asyncio.Redis | redis.asyncio.cluster.RedisCluster = client
        # Until an asyncio cluster client has its slot map it sends scripts to a default node
        # (redis-py 8): a first burst of calls then comes back MOVED, and past a few MOVED the
        # client rebuilds its node table under the calls still in flight, failing some after
        # their script ran. So the first call of a cluster store fetches the map first.
        self._cold = isinstance(client, redis.asyncio.cluster.RedisCluster)
        self._keys = _Keys(prefix, expiry_grace)
        self._reserve = client.register_script(_RESERVE)
        self._settle = client.register_script(_SETTLE)
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)
        self._purge = client.register_script(_PURGE)
        self._abandons: set[asyncio.Task[None]] = set()

    async def reserve(
        self,
        scope: Scope,
        fingerprint: str,
        *,
        now: datetime | None,
        lease: timedelta,
        ttl: timedelta,
    ) -> Reservation:
        if self._cold:
            await self._warm()
        key = self._keys.key(scope)
        args = self._keys.reserve_args(scope, fingerprint, now, lease, ttl)
        try:
            with _translated(scope):
                reply = await self._reserve(keys=[key], args=args)
        except (asyncio.CancelledError, StoreUnavailableError):
            # The command may have run with no one left to hear its token: undo it in the
            # background (the caller is being cancelled or has failed already), by its
            # nonce. redis-py closed the connection, so no pooled connection holds the reply.
            self._abandon(key, args)
            raise
        return self._keys.reservation(reply, scope, fingerprint, now)

    def _abandon(self, key: str, reserve_args: list[str]) -> None:
        task = asyncio.get_running_loop().create_task(
            self._release_by(key, self._keys.abandon_args(reserve_args))
        )
        self._abandons.add(task)
        task.add_done_callback(self._abandons.discard)

    async def _release_by(self, key: str, args: list[str]) -> None:
        # Best effort: if Redis cannot be reached now, the reservation's lease ends it.
        with contextlib.suppress(redis.exceptions.RedisError, OSError):
            await self._release(keys=[key], args=args)

    async def _drain(self) -> None:
        """Wait for the undoing of abandoned reservations (each bounded by the timeouts)."""
        while self._abandons:
            await asyncio.gather(*self._abandons, return_exceptions=True)

    async def _settle_as(
        self,
        scope: Scope,
        token: int,
        status: Status,
        response: bytes,
        now: datetime | None,
        ttl: timedelta,
    ) -> None:
        if self._cold:
            await self._warm()
        args = self._keys.settle_args(token, status, response, now, ttl)
        with _translated(scope):
            done = await self._settle(keys=[self._keys.key(scope)], args=args)
        self._keys.fenced(done, scope, token)

    async def complete(
        self, scope: Scope, token: int, response: bytes, *, now: datetime | None, ttl: timedelta
    ) -> None:
        await self._settle_as(scope, token, Status.COMPLETED, response, now, ttl)

    async def fail(
        self, scope: Scope, token: int, response: bytes, *, now: datetime | None, ttl: timedelta
    ) -> None:
        await self._settle_as(scope, token, Status.FAILED, response, now, ttl)

    async def release(self, scope: Scope, token: int) -> None:
        if self._cold:
            await self._warm()
        with _translated(scope):
            await self._release(keys=[self._keys.key(scope)], args=self._keys.release_args(token))

    async def renew(
        self, scope: Scope, token: int, *, now: datetime | None, lease: timedelta
    ) -> None:
        if self._cold:
            await self._warm()
        args = self._keys.renew_args(token, now, lease)
        with _translated(scope):
            done = await self._renew(keys=[self._keys.key(scope)], args=args)
        self._keys.fenced(done, scope, token)

    async def get(self, scope: Scope) -> Record | None:
        if self._cold:
            await self._warm()
        with _translated(scope):
            fields: Any = await self.client.hgetall(self._keys.key(scope))
        return _record(_flat(fields), scope) if fields else None

    async def evict(self, scope: Scope) -> bool:
        if self._cold:
            await self._warm()
        with _translated(scope):
            return bool(await self.client.delete(self._keys.key(scope)))

    async def _warm(self) -> None:
        assert isinstance(self.client, redis.asyncio.cluster.RedisCluster)
        with _translated():
            await self.client.initialize()  # once; concurrent callers wait on redis-py's lock
        self._cold = False

    async def _scan(self) -> AsyncGenerator[list[Any]]:
        """The prefix's keys, a SCAN page at a time (on a cluster, each primary in turn)."""
        targets: list[dict[str, Any]] = [{}]
        if isinstance(self.client, redis.asyncio.cluster.RedisCluster):
            await self._warm()  # the slot map names the primaries
            targets = _targets(self.client.get_primaries())
        for target in targets:
            cursor = 0
            while True:
                with _translated():
                    reply: Any = await self.client.scan(
                        cursor, match=self._keys.pattern, count=_SCAN_COUNT, **target
                    )
                cursor, keys = _page(reply)
                if keys:
                    yield keys
                if cursor == 0:
                    break

    async def _purge_each(self, keys: list[Any], before: str) -> int:
        if isinstance(self.client, redis.asyncio.cluster.RedisCluster):
            # Cluster pipelines refuse scripts: one call per key, routed to its slot's node.
            with _translated():
                return sum([int(await self._purge(keys=[key], args=[before])) for key in keys])
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            await self._purge(keys=[key], args=[before], client=pipe)
        with _translated():
            return sum(int(done) for done in await pipe.execute())

    async def purge(self, *, before: datetime | None = None, limit: int = 1000) -> int:
        purged = 0
        async with aclosing(self._scan()) as pages:
            async for page in pages:
                start = 0
                while start < len(page) and purged < limit:
                    chunk = page[start : start + limit - purged]
                    start += len(chunk)
                    purged += await self._purge_each(chunk, _us(before))
                    if purged >= limit:
                        return purged
        return purged

    async def stats(self) -> dict[str, int]:
        """How many records are in each state (a SCAN over the prefix)."""
        counts: dict[str, int] = {}
        async for page in self._scan():
            pipe = self.client.pipeline(transaction=False)
            for key in page:
                pipe.hget(key, "st")
            with _translated():
                statuses = await pipe.execute(raise_on_error=False)
            for state, n in self._keys.count(statuses).items():
                counts[state] = counts.get(state, 0) + n
        return counts

    async def aclose(self) -> None:
        await self._drain()
        if self._owned:
            await self.client.aclose()
