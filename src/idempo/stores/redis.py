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
to the caller, who judges it with `judge`. A replay is one round trip; a fresh call is two
(reserve, then settle). Every write after reservation is fenced on the token.

**Time.** The caller's clock is the only clock: ``now``, lease ends and expiries go to the
scripts as integer microseconds since the epoch, and a record whose ``expires_at`` is at or
before the caller's ``now`` is free to take over whatever Redis still holds. Redis's own clock
(TIME) is never read.

**Retention.** Each write sets the key's TTL with PEXPIRE to ``expires_at - now`` (in the
caller's clock) plus a grace period (``expiry_grace``, default one minute), so Redis deletes
records by itself shortly after their retention ends, and never before it does as long as the
application's clocks are sane. `purge` is therefore a safety net rather than a necessity: it
walks the prefix with a bounded SCAN and deletes, with a fenced script per record, up to
``limit`` records whose retention ended by ``before`` (an in-progress record also needs its
lease over), which is what Redis has not expired yet.

**Faults.** Connection errors and timeouts (and, on a cluster, a cluster that is down, has
uncovered slots or cannot be reached at all) raise `StoreUnavailableError` (the guard then runs
nothing); any other Redis error raises `StoreError`. Redis is a *leased* store only: the
business writes and the record never commit together, so it has no ``bind``.

`stats` counts records per state with a SCAN over the prefix: fine for tests and the CLI,
not for a hot path on a large keyspace.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import AsyncGenerator, Iterator
from contextlib import aclosing, contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.cluster
import redis.exceptions

from .._keys import Scope
from .._record import Acquired, Record, Reservation, Status, judge
from ..errors import ConfigurationError, FencedError, StoreError, StoreUnavailableError

__all__ = ["AsyncRedisStore", "RedisStore"]

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_US = timedelta(microseconds=1)
_SCAN_COUNT = 500
_DEFAULT_TIMEOUT = 5.0

# Lua numbers are doubles: microsecond timestamps (~1.8e15) compare exactly, but tostring()
# would print them in exponent form, so times are stored as the strings the caller sent and
# only ever turned into numbers to compare. A TTL goes out through string.format("%.0f").

_COMMON = """
local function ttl_ms(expires_at, now)
  local ms = math.floor((tonumber(expires_at) - tonumber(now)) / 1000)
  if ms < 0 then ms = 0 end
  return string.format('%.0f', ms + tonumber(ARGV[#ARGV]))
end
"""

# KEYS[1] record. ARGV: now, lease_end, expires_at, fingerprint, principal, operation, key,
# grace_ms. Returns {1, token, recovery_point or false} when acquired, else {0, values...}:
# the record's fields in _REPLY_FIELDS order, without names or the scope the caller knows
# (a replay's reply is parsed in Python, where every element costs).
_RESERVE = (
    _COMMON
    + """
local now = tonumber(ARGV[1])
local r = redis.call('HMGET', KEYS[1], 'fp', 'st', 'tok', 'le', 'resp', 'ca', 'ua', 'ea', 'rp')
local token = 1
local created = ARGV[1]
local point = false
if r[3] then
  local alive = tonumber(r[8]) > now
  if alive then
    local lease_over = r[4] and tonumber(r[4]) <= now
    if r[1] ~= ARGV[4] or r[2] ~= 'in_progress' or not lease_over then
      return {0, r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8], r[9]}
    end
    created = r[6]
    point = r[9]
  end
  token = tonumber(r[3]) + 1
  redis.call('DEL', KEYS[1])
end
redis.call('HSET', KEYS[1], 'p', ARGV[5], 'o', ARGV[6], 'k', ARGV[7], 'fp', ARGV[4],
  'st', 'in_progress', 'tok', tostring(token), 'le', ARGV[2], 'ca', created,
  'ua', ARGV[1], 'ea', ARGV[3])
if point then redis.call('HSET', KEYS[1], 'rp', point) end
redis.call('PEXPIRE', KEYS[1], ttl_ms(ARGV[3], ARGV[1]))
return {1, tostring(token), point}
"""
)

# KEYS[1] record. ARGV: token, status, response, now, now + ttl, grace_ms. Returns 1 or 0.
# Settling again with the same token, status and response succeeds without a change: that is
# redis-py retrying a settle whose reply the connection lost.
_SETTLE = (
    _COMMON
    + """
local r = redis.call('HMGET', KEYS[1], 'tok', 'st', 'ea', 'resp')
if r[1] ~= ARGV[1] then return 0 end
if r[2] ~= 'in_progress' then
  if r[2] == ARGV[2] and r[4] == ARGV[3] then return 1 end
  return 0
end
local expires = r[3]
local extended = tonumber(ARGV[5]) > tonumber(expires)
if extended then expires = ARGV[5] end
redis.call('HSET', KEYS[1], 'st', ARGV[2], 'resp', ARGV[3], 'ua', ARGV[4], 'ea', expires)
redis.call('HDEL', KEYS[1], 'le')
-- The key's TTL already ends a grace period after 'ea' (every write of 'ea' sets it), so
-- only a longer retention needs a new one: each call here costs the server microseconds.
if extended then redis.call('PEXPIRE', KEYS[1], ttl_ms(expires, ARGV[4])) end
return 1
"""
)

# KEYS[1] record. ARGV: token, now, lease_end, grace_ms. Returns 1 or 0.
_RENEW = (
    _COMMON
    + """
local r = redis.call('HMGET', KEYS[1], 'tok', 'st', 'ea')
if r[1] ~= ARGV[1] or r[2] ~= 'in_progress' then return 0 end
local expires = r[3]
if tonumber(ARGV[3]) > tonumber(expires) then expires = ARGV[3] end
redis.call('HSET', KEYS[1], 'le', ARGV[3], 'ua', ARGV[2], 'ea', expires)
redis.call('PEXPIRE', KEYS[1], ttl_ms(expires, ARGV[2]))
return 1
"""
)

# KEYS[1] record. ARGV: token. Deletes an in-progress record held with that token.
_RELEASE = """
local r = redis.call('HMGET', KEYS[1], 'tok', 'st')
if r[1] == ARGV[1] and r[2] == 'in_progress' then return redis.call('DEL', KEYS[1]) end
return 0
"""

# KEYS[1] record. ARGV: before. Deletes it if its retention (and any lease) ended by then.
_PURGE = """
local r = redis.call('HMGET', KEYS[1], 'st', 'ea', 'le')
if not r[1] then return 0 end
local before = tonumber(ARGV[1])
if tonumber(r[2]) > before then return 0 end
if r[1] == 'in_progress' and r[3] and tonumber(r[3]) > before then return 0 end
return redis.call('DEL', KEYS[1])
"""


def _us(moment: datetime) -> str:
    return str((moment - _EPOCH) // _US)


def _time(value: bytes) -> datetime:
    return _EPOCH + timedelta(microseconds=int(value))


_REPLY_FIELDS = (b"fp", b"st", b"tok", b"le", b"resp", b"ca", b"ua", b"ea", b"rp")


def _record(flat: list[bytes]) -> Record:
    f = {flat[i]: flat[i + 1] for i in range(0, len(flat), 2)}
    scope = Scope(principal=f[b"p"].decode(), operation=f[b"o"].decode(), key=f[b"k"].decode())
    return _fields_record(f, scope)


def _fields_record(f: dict[bytes, bytes], scope: Scope) -> Record:
    lease = f.get(b"le")
    point = f.get(b"rp")
    return Record(
        scope=scope,
        fingerprint=f[b"fp"].decode(),
        status=Status(f[b"st"].decode()),
        token=int(f[b"tok"]),
        lease_expires_at=_time(lease) if lease is not None else None,
        response=f.get(b"resp"),
        created_at=_time(f[b"ca"]),
        updated_at=_time(f[b"ua"]),
        expires_at=_time(f[b"ea"]),
        recovery_point=point.decode() if point is not None else None,
    )


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


@contextmanager
def _translated() -> Iterator[None]:
    """Redis errors as idempo's: unreachable (fail closed, retry later) or a store fault."""
    try:
        yield
    except _UNREACHABLE as exc:
        raise StoreUnavailableError(f"Redis is unreachable: {exc}") from exc
    except redis.exceptions.RedisClusterException as exc:
        # redis-py's cluster client reports "no seed node answers" as its own exception,
        # with the connection error as the cause; anything else is a misuse or a fault.
        if isinstance(exc.__cause__, _UNREACHABLE):
            raise StoreUnavailableError(f"Redis Cluster is unreachable: {exc}") from exc
        raise StoreError(f"Redis Cluster failed: {exc}") from exc
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
        self.grace_ms = str(max(1, expiry_grace // timedelta(milliseconds=1)))
        escaped = "".join("\\" + c if c in "*?[]\\" else c for c in prefix)
        self.pattern = escaped + ":{*}"

    def key(self, scope: Scope) -> str:
        return f"{self.prefix}:{{{_digest(scope)}}}"

    def reserve_args(
        self, scope: Scope, fingerprint: str, now: datetime, lease: timedelta, ttl: timedelta
    ) -> list[str]:
        return [
            _us(now),
            _us(now + lease),
            _us(now + lease + ttl),
            fingerprint,
            scope.principal,
            scope.operation,
            scope.key,
            self.grace_ms,
        ]

    def settle_args(
        self, token: int, status: Status, response: bytes, now: datetime, ttl: timedelta
    ) -> list[str | bytes]:
        return [str(token), status.value, bytes(response), _us(now), _us(now + ttl), self.grace_ms]

    def renew_args(self, token: int, now: datetime, lease: timedelta) -> list[str]:
        return [str(token), _us(now), _us(now + lease), self.grace_ms]

    @staticmethod
    def reservation(
        reply: list[Any], scope: Scope, fingerprint: str, now: datetime
    ) -> Reservation | None:
        """What the reserve script found; None if the record vanished between (try again)."""
        if int(reply[0]) == 1:
            point = reply[2]
            return Acquired(
                token=int(reply[1]),
                recovery_point=point.decode() if isinstance(point, bytes) else None,
            )
        # A missing field comes back as nil (RESP2) or false (RESP3).
        fields = {
            n: v for n, v in zip(_REPLY_FIELDS, reply[1:], strict=True) if isinstance(v, bytes)
        }
        return judge(_fields_record(fields, scope), fingerprint, now)

    @staticmethod
    def fenced(done: Any, scope: Scope, token: int) -> None:
        if not int(done):
            raise FencedError(f"key {scope.key!r}: token {token} is stale")

    @staticmethod
    def count(statuses: list[bytes | None]) -> dict[str, int]:
        counts: dict[str, int] = {}
        for status in statuses:
            if status is not None:
                name = status.decode()
                counts[name] = counts.get(name, 0) + 1
        return counts


def _check_client(client: Any) -> None:
    if client.get_encoder().decode_responses:
        raise ConfigurationError("the Redis client must not decode responses (bytes are stored)")


def _client_options(options: dict[str, Any]) -> dict[str, Any]:
    options.setdefault("socket_timeout", _DEFAULT_TIMEOUT)
    options.setdefault("socket_connect_timeout", _DEFAULT_TIMEOUT)
    if options.get("decode_responses"):
        raise ConfigurationError("the Redis client must not decode responses (bytes are stored)")
    return options


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


def _from_url(url: str, options: dict[str, Any], single: Any, cluster: Any, node: Any) -> Any:
    """A client for ``url``: ``single.from_url``, or for a cluster URL ``cluster.from_url``
    with every seed node (``node`` is the ClusterNode class of the same face)."""
    options = _client_options(options)
    seeds = _cluster_seeds(url)
    if seeds is None:
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
                url, options, redis.Redis, redis.cluster.RedisCluster, redis.cluster.ClusterNode
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
        self, scope: Scope, fingerprint: str, *, now: datetime, lease: timedelta, ttl: timedelta
    ) -> Reservation:
        key = self._keys.key(scope)
        args = self._keys.reserve_args(scope, fingerprint, now, lease, ttl)
        while True:
            with _translated():
                reply = self._reserve(keys=[key], args=args)
            reservation = self._keys.reservation(reply, scope, fingerprint, now)
            if reservation is not None:
                return reservation

    def _settle_as(
        self,
        scope: Scope,
        token: int,
        status: Status,
        response: bytes,
        now: datetime,
        ttl: timedelta,
    ) -> None:
        args = self._keys.settle_args(token, status, response, now, ttl)
        with _translated():
            done = self._settle(keys=[self._keys.key(scope)], args=args)
        self._keys.fenced(done, scope, token)

    def complete(
        self, scope: Scope, token: int, response: bytes, *, now: datetime, ttl: timedelta
    ) -> None:
        self._settle_as(scope, token, Status.COMPLETED, response, now, ttl)

    def fail(
        self, scope: Scope, token: int, response: bytes, *, now: datetime, ttl: timedelta
    ) -> None:
        self._settle_as(scope, token, Status.FAILED, response, now, ttl)

    def release(self, scope: Scope, token: int) -> None:
        with _translated():
            self._release(keys=[self._keys.key(scope)], args=[str(token)])

    def renew(self, scope: Scope, token: int, *, now: datetime, lease: timedelta) -> None:
        args = self._keys.renew_args(token, now, lease)
        with _translated():
            done = self._renew(keys=[self._keys.key(scope)], args=args)
        self._keys.fenced(done, scope, token)

    def get(self, scope: Scope) -> Record | None:
        with _translated():
            fields: Any = self.client.hgetall(self._keys.key(scope))
        return _record(_flat(fields)) if fields else None

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

    def purge(self, *, before: datetime, limit: int = 1000) -> int:
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
                statuses = pipe.execute()
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

    async def reserve(
        self, scope: Scope, fingerprint: str, *, now: datetime, lease: timedelta, ttl: timedelta
    ) -> Reservation:
        if self._cold:
            await self._warm()
        key = self._keys.key(scope)
        args = self._keys.reserve_args(scope, fingerprint, now, lease, ttl)
        while True:
            with _translated():
                reply = await self._reserve(keys=[key], args=args)
            reservation = self._keys.reservation(reply, scope, fingerprint, now)
            if reservation is not None:
                return reservation

    async def _settle_as(
        self,
        scope: Scope,
        token: int,
        status: Status,
        response: bytes,
        now: datetime,
        ttl: timedelta,
    ) -> None:
        if self._cold:
            await self._warm()
        args = self._keys.settle_args(token, status, response, now, ttl)
        with _translated():
            done = await self._settle(keys=[self._keys.key(scope)], args=args)
        self._keys.fenced(done, scope, token)

    async def complete(
        self, scope: Scope, token: int, response: bytes, *, now: datetime, ttl: timedelta
    ) -> None:
        await self._settle_as(scope, token, Status.COMPLETED, response, now, ttl)

    async def fail(
        self, scope: Scope, token: int, response: bytes, *, now: datetime, ttl: timedelta
    ) -> None:
        await self._settle_as(scope, token, Status.FAILED, response, now, ttl)

    async def release(self, scope: Scope, token: int) -> None:
        if self._cold:
            await self._warm()
        with _translated():
            await self._release(keys=[self._keys.key(scope)], args=[str(token)])

    async def renew(self, scope: Scope, token: int, *, now: datetime, lease: timedelta) -> None:
        if self._cold:
            await self._warm()
        args = self._keys.renew_args(token, now, lease)
        with _translated():
            done = await self._renew(keys=[self._keys.key(scope)], args=args)
        self._keys.fenced(done, scope, token)

    async def get(self, scope: Scope) -> Record | None:
        if self._cold:
            await self._warm()
        with _translated():
            fields: Any = await self.client.hgetall(self._keys.key(scope))
        return _record(_flat(fields)) if fields else None

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

    async def purge(self, *, before: datetime, limit: int = 1000) -> int:
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
                statuses = await pipe.execute()
            for state, n in self._keys.count(statuses).items():
                counts[state] = counts.get(state, 0) + n
        return counts

    async def aclose(self) -> None:
        if self._owned:
            await self.client.aclose()
