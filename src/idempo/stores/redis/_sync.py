"""`RedisStore`: the operations of `_ops`, carried out with redis-py's synchronous client."""

from __future__ import annotations

import time
from collections.abc import Generator
from datetime import datetime, timedelta
from typing import Any, TypeVar

import redis
import redis.cluster
import redis.exceptions
import redis.retry

from ..._core.keys import Scope
from ..._core.record import Record, Reservation, Status
from .._scan import ScanFilter
from . import _ops
from ._connect import connect
from ._errors import ERRORS, translated
from ._lane import lane_for
from ._ops import Batch, Call, Command, Place, Run
from ._protocol import Keys, wrong_type
from ._scripts import SCRIPTS

T = TypeVar("T")

_CLASSES = (redis.Redis, redis.cluster.RedisCluster, redis.cluster.ClusterNode, redis.retry.Retry)


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
        built, self._owned = connect("RedisStore", url, client, options, _CLASSES)
        self.client: redis.Redis | redis.cluster.RedisCluster = built
        self._keys = Keys(prefix, expiry_grace)
        self._cluster = isinstance(built, redis.cluster.RedisCluster)
        self._scripts = {name: built.register_script(text) for name, text in SCRIPTS.items()}
        self._place = Place()
        self._lane = lane_for(built, self._owned)

    def _drive(self, flow: Generator[Call, Any, T]) -> T:
        """Carry out the calls ``flow`` yields; its result."""
        try:
            call = next(flow)
            while True:
                try:
                    reply = self._do(call)
                except ERRORS as exc:
                    if not (isinstance(call, Command) and call.errors and wrong_type(exc)):
                        raise translated(exc, call.scope) from exc
                    reply = exc
                call = flow.send(reply)
        except StopIteration as stop:
            result: T = stop.value
            return result

    def _do(self, call: Call) -> Any:
        if isinstance(call, Run):
            return self._evalsha(call)
        if isinstance(call, Command):
            if call.name == "execute_command" and self._lane is not None:
                return self._lane.call(*call.args)  # the reservation's SET: its reply is raw
            return getattr(self.client, call.name)(*call.args, **call.options)
        if isinstance(call, Batch):
            pipe = self.client.pipeline(transaction=False)
            for each in call.calls:
                if isinstance(each, Run):
                    self._scripts[each.script](keys=each.keys, args=each.args, client=pipe)
                else:
                    getattr(pipe, each.name)(*each.args, **each.options)
            return pipe.execute(raise_on_error=call.raise_on_error)
        assert isinstance(self.client, redis.cluster.RedisCluster)
        return self.client.get_primaries()  # type: ignore[no-untyped-call]

    def _evalsha(self, run: Run) -> Any:
        """``run`` as one EVALSHA (redis-py's Script adds argument checks the hot path pays
        for); a server that lost the script gets it again."""
        script = self._scripts[run.script]
        send = self.client.execute_command if self._lane is None else self._lane.call
        try:
            return send("EVALSHA", script.sha, len(run.keys), *run.keys, *run.args)
        except redis.exceptions.NoScriptError:
            return script(keys=run.keys, args=run.args)  # loads it, then runs it

    def reserve(
        self,
        scope: Scope,
        fingerprint: str,
        *,
        now: datetime | None,
        lease: timedelta,
        ttl: timedelta,
    ) -> Reservation:
        return self._drive(_ops.reserve(self._keys, scope, fingerprint, now, lease, ttl))

    def complete(
        self, scope: Scope, token: int, response: bytes, *, now: datetime | None, ttl: timedelta
    ) -> None:
        self._drive(_ops.settle(self._keys, scope, token, Status.COMPLETED, response, now, ttl))

    def fail(
        self, scope: Scope, token: int, response: bytes, *, now: datetime | None, ttl: timedelta
    ) -> None:
        self._drive(_ops.settle(self._keys, scope, token, Status.FAILED, response, now, ttl))

    def release(self, scope: Scope, token: int) -> None:
        self._drive(_ops.release(self._keys, scope, token))

    def renew(self, scope: Scope, token: int, *, now: datetime | None, lease: timedelta) -> None:
        self._drive(_ops.renew(self._keys, scope, token, now, lease))

    def checkpoint(
        self, scope: Scope, token: int, point: str | None, *, now: datetime | None, lease: timedelta
    ) -> None:
        """Record the recovery point ``point`` (None: keep the stored one) and extend the lease;
        fenced on ``token``."""
        self._drive(_ops.checkpoint(self._keys, scope, token, point, now, lease))

    def get(self, scope: Scope) -> Record | None:
        return self._drive(_ops.get(self._keys, scope))

    def evict(self, scope: Scope) -> bool:
        return self._drive(_ops.evict(self._keys, scope))

    def wait_settled(self, scope: Scope, seconds: float) -> None:
        """Return once the record of ``scope`` is no longer in progress, or ``seconds``
        later: a duplicate told to wait (``Policy.wait``) reserves again as soon as the
        first attempt settles or releases (their scripts publish on the record's key name)
        instead of polling. Subscribed before the record is read and marked (lua/mark.lua:
        a fresh reservation's settle publishes only once marked), so no settle falls in
        between. Any failure only ends the wait: the reservation that follows meets it."""
        deadline = time.monotonic() + seconds
        pubsub = self.client.pubsub()  # type: ignore[no-untyped-call,unused-ignore]  # typed from redis 8.2
        try:
            pubsub.subscribe(self._keys.key(scope))
            if not _confirmed(pubsub.get_message(timeout=seconds)):
                return
            if not self._drive(_ops.mark(self._keys, scope)):
                return
            while (left := deadline - time.monotonic()) > 0:
                message = pubsub.get_message(timeout=left)
                if message is not None and message["type"] == "message":
                    return
        except Exception:  # noqa: BLE001 - see the docstring
            return
        finally:
            pubsub.close()

    def purge(self, *, before: datetime | None = None, limit: int = 1000) -> int:
        return self._drive(_ops.purge(self._keys, self._place, before, limit, self._cluster))

    def stats(self) -> dict[str, int]:
        """How many records are in each state (a SCAN over the prefix)."""
        return self._drive(_ops.stats(self._keys, self._cluster))

    def scan(
        self,
        *,
        status: Status | None = None,
        operation: str | None = None,
        principal: str | None = None,
        created_before: datetime | None = None,
        limit: int = 100,
    ) -> list[Record]:
        """Up to ``limit`` records passing every filter given, without their responses (a
        SCAN over the prefix that stops once it found enough; those found oldest first)."""
        where = ScanFilter(status, operation, principal, created_before, limit)
        return self._drive(_ops.scan(self._keys, where, self._cluster))

    def close(self) -> None:
        if self._lane is not None:
            self._lane.close()
        if self._owned:
            self.client.close()
            if isinstance(self.client, redis.cluster.RedisCluster):
                # A cluster client built from a URL gives each node a pool its close leaves
                # open (redis-py): close them here, or their sockets linger until collected.
                for node in self.client.get_nodes():  # type: ignore[no-untyped-call]
                    if node.redis_connection is not None:
                        node.redis_connection.connection_pool.disconnect()


def _confirmed(message: Any) -> bool:
    """Whether ``message`` is the server's confirmation of a subscription (from then on, no
    publication on the channel is missed)."""
    return isinstance(message, dict) and message.get("type") in ("subscribe", b"subscribe")
