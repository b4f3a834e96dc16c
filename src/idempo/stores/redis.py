"""Redis store: one hash per record, every state transition one Lua script.

    RedisStore("redis://127.0.0.1:6379/0")            # or RedisStore(client=redis.Redis(...))
    AsyncRedisStore("rediss://cache:6380/1", prefix="payments")

**Keys.** A record lives in one hash at ``<prefix>:{<sha256 hex>}``, the digest taken over the
scope (principal, operation, key). User strings never appear in key names; they are kept
inside the hash. The braces are a Redis Cluster hash tag, so everything about one record maps
to one slot (this module does not run on Redis Cluster itself yet).

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

**Faults.** Connection errors and timeouts raise `StoreUnavailableError` (the guard then runs
nothing); any other Redis error raises `StoreError`. Redis is a *leased* store only: the
business writes and the record never commit together, so it has no ``bind``.

`stats` counts records per state with a SCAN over the prefix: fine for tests and the CLI,
not for a hot path on a large keyspace.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import redis
import redis.asyncio
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
# grace_ms. Returns {1, token, recovery_point or false} when acquired, else {0, fields}.
_RESERVE = (
    _COMMON
    + """
local now = tonumber(ARGV[1])
local fields = redis.call('HGETALL', KEYS[1])
local token = 1
local created = ARGV[1]
local point = false
if #fields > 0 then
  local r = {}
  for i = 1, #fields, 2 do r[fields[i]] = fields[i + 1] end
  local alive = tonumber(r.ea) > now
  if alive then
    local lease_over = r.le and tonumber(r.le) <= now
    if r.fp ~= ARGV[4] or r.st ~= 'in_progress' or not lease_over then
      return {0, fields}
    end
    created = r.ca
    if r.rp then point = r.rp end
  end
  token = tonumber(r.tok) + 1
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
if tonumber(ARGV[5]) > tonumber(expires) then expires = ARGV[5] end
redis.call('HSET', KEYS[1], 'st', ARGV[2], 'resp', ARGV[3], 'ua', ARGV[4], 'ea', expires)
redis.call('HDEL', KEYS[1], 'le')
redis.call('PEXPIRE', KEYS[1], ttl_ms(expires, ARGV[4]))
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


def _record(flat: list[bytes]) -> Record:
    f = {flat[i]: flat[i + 1] for i in range(0, len(flat), 2)}
    lease = f.get(b"le")
    point = f.get(b"rp")
    return Record(
        scope=Scope(principal=f[b"p"].decode(), operation=f[b"o"].decode(), key=f[b"k"].decode()),
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


@contextmanager
def _translated() -> Iterator[None]:
    """Redis errors as idempo's: unreachable (fail closed, retry later) or a store fault."""
    try:
        yield
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
        raise StoreUnavailableError(f"Redis is unreachable: {exc}") from exc
    except redis.exceptions.RedisError as exc:
        raise StoreError(f"Redis failed: {exc}") from exc


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
        triple = json.dumps([scope.principal, scope.operation, scope.key])
        return f"{self.prefix}:{{{hashlib.sha256(triple.encode()).hexdigest()}}}"

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
    def reservation(reply: list[Any], fingerprint: str, now: datetime) -> Reservation | None:
        """What the reserve script found; None if the record vanished between (try again)."""
        if int(reply[0]) == 1:
            point = reply[2]
            return Acquired(
                token=int(reply[1]),
                recovery_point=point.decode() if isinstance(point, bytes) else None,
            )
        return judge(_record(reply[1]), fingerprint, now)

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
    if client.connection_pool.connection_kwargs.get("decode_responses"):
        raise ConfigurationError("the Redis client must not decode responses (bytes are stored)")


def _client_options(options: dict[str, Any]) -> dict[str, Any]:
    options.setdefault("socket_timeout", _DEFAULT_TIMEOUT)
    options.setdefault("socket_connect_timeout", _DEFAULT_TIMEOUT)
    if options.get("decode_responses"):
        raise ConfigurationError("the Redis client must not decode responses (bytes are stored)")
    return options


class RedisStore:
    """A `Store` in Redis (leased mode only), on a client built from ``url`` or the app's own.

    Args:
        url: ``redis://host:port/db`` or ``rediss://...``; extra keyword options go to
            ``redis.Redis.from_url`` (5 s socket and connect timeouts unless given).
        client: a ``redis.Redis`` the app owns (``decode_responses`` off); `close` leaves it
            open.
        prefix: the first part of every key name, so several apps or tests share a database.
        expiry_grace: how long after a record's retention Redis keeps it before expiring it.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        client: redis.Redis | None = None,
        prefix: str = "idempo",
        expiry_grace: timedelta = timedelta(minutes=1),
        **options: Any,
    ) -> None:
        if (url is None) == (client is None):
            raise ConfigurationError("give RedisStore a URL or a client, not both")
        if client is None:
            assert url is not None
            client = redis.Redis.from_url(url, **_client_options(options))
            self._owned = True
        else:
            _check_client(client)
            self._owned = False
        self.client: redis.Redis = client
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
            reservation = self._keys.reservation(reply, fingerprint, now)
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
        """The prefix's keys, a SCAN page at a time."""
        cursor: int = 0
        while True:
            with _translated():
                reply: Any = self.client.scan(cursor, match=self._keys.pattern, count=_SCAN_COUNT)
            cursor, keys = reply
            if keys:
                yield keys
            if cursor == 0:
                return

    def purge(self, *, before: datetime, limit: int = 1000) -> int:
        purged = 0
        for page in self._scan():
            start = 0
            while start < len(page) and purged < limit:
                chunk = page[start : start + limit - purged]
                start += len(chunk)
                pipe = self.client.pipeline(transaction=False)
                for key in chunk:
                    self._purge(keys=[key], args=[_us(before)], client=pipe)
                with _translated():
                    purged += sum(int(done) for done in pipe.execute())
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


class AsyncRedisStore:
    """The asynchronous twin of `RedisStore`, on ``redis.asyncio.Redis``."""

    def __init__(
        self,
        url: str | None = None,
        *,
        client: redis.asyncio.Redis | None = None,
        prefix: str = "idempo",
        expiry_grace: timedelta = timedelta(minutes=1),
        **options: Any,
    ) -> None:
        if (url is None) == (client is None):
            raise ConfigurationError("give AsyncRedisStore a URL or a client, not both")
        if client is None:
            assert url is not None
            client = redis.asyncio.Redis.from_url(url, **_client_options(options))
            self._owned = True
        else:
            _check_client(client)
            self._owned = False
        self.client: redis.asyncio.Redis = client
        self._keys = _Keys(prefix, expiry_grace)
        self._reserve = client.register_script(_RESERVE)
        self._settle = client.register_script(_SETTLE)
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)
        self._purge = client.register_script(_PURGE)

    async def reserve(
        self, scope: Scope, fingerprint: str, *, now: datetime, lease: timedelta, ttl: timedelta
    ) -> Reservation:
        key = self._keys.key(scope)
        args = self._keys.reserve_args(scope, fingerprint, now, lease, ttl)
        while True:
            with _translated():
                reply = await self._reserve(keys=[key], args=args)
            reservation = self._keys.reservation(reply, fingerprint, now)
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
        with _translated():
            await self._release(keys=[self._keys.key(scope)], args=[str(token)])

    async def renew(self, scope: Scope, token: int, *, now: datetime, lease: timedelta) -> None:
        args = self._keys.renew_args(token, now, lease)
        with _translated():
            done = await self._renew(keys=[self._keys.key(scope)], args=args)
        self._keys.fenced(done, scope, token)

    async def get(self, scope: Scope) -> Record | None:
        with _translated():
            fields: Any = await self.client.hgetall(self._keys.key(scope))
        return _record(_flat(fields)) if fields else None

    async def _scan_page(self, cursor: int) -> tuple[int, list[Any]]:
        with _translated():
            result: Any = await self.client.scan(
                cursor, match=self._keys.pattern, count=_SCAN_COUNT
            )
        return int(result[0]), list(result[1])

    async def purge(self, *, before: datetime, limit: int = 1000) -> int:
        purged = 0
        cursor = 0
        while True:
            cursor, page = await self._scan_page(cursor)
            start = 0
            while start < len(page) and purged < limit:
                chunk = page[start : start + limit - purged]
                start += len(chunk)
                pipe = self.client.pipeline(transaction=False)
                for key in chunk:
                    await self._purge(keys=[key], args=[_us(before)], client=pipe)
                with _translated():
                    purged += sum(int(done) for done in await pipe.execute())
                if purged >= limit:
                    return purged
            if cursor == 0:
                return purged

    async def stats(self) -> dict[str, int]:
        """How many records are in each state (a SCAN over the prefix)."""
        counts: dict[str, int] = {}
        cursor = 0
        while True:
            cursor, page = await self._scan_page(cursor)
            if page:
                pipe = self.client.pipeline(transaction=False)
                for key in page:
                    pipe.hget(key, "st")
                with _translated():
                    statuses = await pipe.execute()
                for state, n in self._keys.count(statuses).items():
                    counts[state] = counts.get(state, 0) + n
            if cursor == 0:
                return counts

    async def aclose(self) -> None:
        if self._owned:
            await self.client.aclose()
