"""redis-py's errors as idempo's: unreachable (fail closed, retry later), a record that holds
something else than a hash, or a store fault."""

from __future__ import annotations

import errno
import re
from collections.abc import Iterator
from contextlib import contextmanager

import redis.exceptions

from ..._core.keys import Scope
from ...errors import StoreError, StoreUnavailableError
from .. import cannot_connect
from ._protocol import corrupt

# Everything redis-py raises (its cluster client's own exceptions are not RedisErrors).
ERRORS = (redis.exceptions.RedisError, redis.exceptions.RedisClusterException)

# Cannot reach the data right now: a connection or a timeout, a cluster that is down or
# resharding, or a slot no reachable node serves.
_UNREACHABLE = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.TryAgainError,
    redis.exceptions.SlotNotCoveredError,
)

_CONNECTING = re.compile(r"Error (-?\d+) connecting to (\S+?)\.(?: |$)")
_REFUSED, _UNKNOWN_HOST = {errno.ECONNREFUSED}, {-2, -3, -5}  # EAI_NONAME, EAI_AGAIN, EAI_NODATA


def translated(exc: Exception, scope: Scope | None = None) -> Exception:
    """idempo's error for one of `ERRORS`, raised on a call about ``scope``'s record."""
    if isinstance(exc, _UNREACHABLE):
        return _unreachable(exc)
    if isinstance(exc, redis.exceptions.RedisClusterException):
        # redis-py's cluster client reports "no seed node answers" as its own exception,
        # with the connection error as the cause; anything else is a misuse or a fault.
        if isinstance(exc.__cause__, _UNREACHABLE):
            return StoreUnavailableError(f"Redis Cluster is unreachable: {exc}")
        return StoreError(f"Redis Cluster failed: {exc}")
    if isinstance(exc, redis.exceptions.ResponseError):
        if scope is not None and str(exc).startswith("WRONGTYPE"):
            return corrupt(scope, exc)
        if "DB index is out of range" in str(exc):  # the SELECT of a new connection
            return StoreUnavailableError(f"the Redis database in the URL does not exist ({exc})")
    return StoreError(f"Redis failed: {exc}")


@contextmanager
def translating(scope: Scope | None = None) -> Iterator[None]:
    """`translated` around a block (connecting, not the verbs: the faces catch those)."""
    try:
        yield
    except ERRORS as exc:
        raise translated(exc, scope) from exc


def _unreachable(exc: Exception) -> StoreUnavailableError:
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
