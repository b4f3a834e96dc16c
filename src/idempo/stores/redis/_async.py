"""`AsyncRedisStore`: the operations of `_ops`, carried out with ``redis.asyncio``."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Generator
from datetime import datetime, timedelta
from typing import Any, TypeVar

import redis.asyncio
import redis.asyncio.cluster
import redis.asyncio.retry
import redis.exceptions

from ..._core.flow import CLEANUP_TIMEOUT, outlast
from ..._core.keys import Scope
from ..._core.record import Record, Reservation, Status
from ...errors import StoreUnavailableError
from .._scan import ScanFilter
from . import _ops
from ._connect import connect
from ._errors import ERRORS, translated, translating
from ._lane import async_lane_for
from ._ops import Batch, Call, Command, Place, Run
from ._protocol import Keys, wrong_type
from ._scripts import SCRIPTS
from ._sync import _confirmed

T = TypeVar("T")

_CLASSES = (
    redis.asyncio.Redis,
    redis.asyncio.cluster.RedisCluster,
    redis.asyncio.cluster.ClusterNode,
    redis.asyncio.retry.Retry,
)


class AsyncRedisStore:
    """The asynchronous twin of `RedisStore`, on ``redis.asyncio.Redis`` or
    ``redis.asyncio.cluster.RedisCluster`` (which connects on first use).

        store = AsyncRedisStore(client=redis.asyncio.cluster.RedisCluster(host="10.0.0.1"))

    A reserve whose answer never came (the caller was cancelled, or the connection failed
    after sending it) may have reserved all the same, with no one left to settle it: the store
    undoes it by the reservation's nonce, so the key is not held for a lease. A cancelled
    reserve waits for its undo (shielded, and bounded as the guard's cleanup is) before the
    cancellation goes on; after a connection failure the undo runs in the background. `aclose`
    waits for those undos.
    """

    # What the above promises the guard, on the store's own client (its lane): a reserve
    # cancelled under way leaves nothing held once it has raised (a takeover of committed
    # steps is left with its lease ended, lua/release.lua), so the flow awaits it in the
    # caller's task (`_core.flow.apump`), with no task of its own to shield it. The undo
    # must reach Redis after the reserve: the lane reads the cancelled command's reply
    # first, where a cluster's or an app's client could let the undo overtake it.
    undoes_cancelled_reserve = False

    def __init__(
        self,
        url: str | None = None,
        *,
        client: redis.asyncio.Redis | redis.asyncio.cluster.RedisCluster | None = None,
        prefix: str = "idempo",
        expiry_grace: timedelta = timedelta(minutes=1),
        **options: Any,
    ) -> None:
        built, self._owned = connect("AsyncRedisStore", url, client, options, _CLASSES)
        self.client: redis.asyncio.Redis | redis.asyncio.cluster.RedisCluster = built
        self._keys = Keys(prefix, expiry_grace)
        self._cluster = isinstance(built, redis.asyncio.cluster.RedisCluster)
        # Until an asyncio cluster client has its slot map it sends scripts to a default node
        # (redis-py 8): a first burst of calls then comes back MOVED, and past a few MOVED the
        # client rebuilds its node table under the calls still in flight, failing some after
        # their script ran. So the first call of a cluster store fetches the map first.
        self._cold = self._cluster
        self._scripts = {name: built.register_script(text) for name, text in SCRIPTS.items()}
        self._lane = async_lane_for(built, self._owned)
        self.undoes_cancelled_reserve = self._lane is not None
        self._undoing: set[asyncio.Task[None]] = set()
        self._place = Place()

    async def _drive(self, flow: Generator[Call, Any, T]) -> T:
        """Carry out the calls ``flow`` yields; its result."""
        if self._cold:
            await self._warm()
        try:
            call = next(flow)
            while True:
                try:
                    reply = await self._start(call)
                except asyncio.CancelledError:
                    undoing = self._undo(call)
                    if undoing is not None:
                        await outlast(undoing)
                    raise
                except ERRORS as exc:
                    if isinstance(call, Command) and call.errors and wrong_type(exc):
                        reply = exc
                    else:
                        error = translated(exc, call.scope)
                        if isinstance(error, StoreUnavailableError):
                            self._undo(call)
                        raise error from exc
                call = flow.send(reply)
        except StopIteration as stop:
            result: T = stop.value
            return result

    def _start(self, call: Call) -> Awaitable[Any]:
        """The awaitable that carries out ``call``: a script's or a command's own coroutine,
        not one more coroutine around it (every await passes through each)."""
        started: Awaitable[Any]
        if isinstance(call, Run):
            started = self._evalsha(call)
        elif isinstance(call, Command):
            if call.name == "execute_command" and self._lane is not None:
                started = self._lane.call(*call.args)  # the reservation's SET: a raw reply
            else:
                started = getattr(self.client, call.name)(*call.args, **call.options)
        elif isinstance(call, Batch):
            started = self._pipelined(call)
        else:
            started = self._primaries()
        return started

    async def _evalsha(self, run: Run) -> Any:
        """``run`` as one EVALSHA (redis-py's Script adds argument checks the hot path pays
        for); a server that lost the script gets it again."""
        script = self._scripts[run.script]
        send = self.client.execute_command if self._lane is None else self._lane.call
        try:
            return await send("EVALSHA", script.sha, len(run.keys), *run.keys, *run.args)
        except redis.exceptions.NoScriptError:
            # Loaded, then sent again on the lane: cancelled there, its reply is read before
            # an undo leaves (`_best_effort`).
            await self.client.script_load(script.script)
            return await send("EVALSHA", script.sha, len(run.keys), *run.keys, *run.args)

    async def _pipelined(self, batch: Batch) -> Any:
        pipe = self.client.pipeline(transaction=False)
        for each in batch.calls:
            if isinstance(each, Run):
                await self._scripts[each.script](keys=each.keys, args=each.args, client=pipe)
            else:
                getattr(pipe, each.name)(*each.args, **each.options)
        return await pipe.execute(raise_on_error=batch.raise_on_error)

    async def _primaries(self) -> Any:
        assert isinstance(self.client, redis.asyncio.cluster.RedisCluster)
        return self.client.get_primaries()  # the slot map is known: _drive warmed it

    async def _warm(self) -> None:
        assert isinstance(self.client, redis.asyncio.cluster.RedisCluster)
        with translating():
            await self.client.initialize()  # once; concurrent callers wait on redis-py's lock
        self._cold = False

    def _undo(self, call: Call) -> asyncio.Task[None] | None:
        """Undo in a task of its own what ``call`` may have done with no one left to hear
        its reply (the caller is being cancelled or has failed already); the task, or None
        when there is nothing to undo. redis-py closed the connection, so no pooled
        connection holds the reply."""
        undo = _ops.undo(call)
        if undo is None:
            return None
        task = asyncio.get_running_loop().create_task(self._best_effort(undo))
        self._undoing.add(task)
        task.add_done_callback(self._undoing.discard)
        return task

    async def _best_effort(self, call: Call) -> None:
        # If Redis cannot be reached now, the reservation's lease ends it.
        with contextlib.suppress(*ERRORS, OSError):
            if self._lane is not None:
                # The cancelled command's reply is read first: then the undo reaches Redis
                # after what it undoes, though each may travel on a connection of its own.
                await self._lane.settled(CLEANUP_TIMEOUT)
            await self._start(call)

    async def _drain(self) -> None:
        """Wait for the undos under way (each bounded by the timeouts)."""
        while self._undoing:
            await asyncio.gather(*self._undoing, return_exceptions=True)

    async def reserve(
        self,
        scope: Scope,
        fingerprint: str,
        *,
        now: datetime | None,
        lease: timedelta,
        ttl: timedelta,
    ) -> Reservation:
        return await self._drive(_ops.reserve(self._keys, scope, fingerprint, now, lease, ttl))

    async def complete(
        self, scope: Scope, token: int, response: bytes, *, now: datetime | None, ttl: timedelta
    ) -> None:
        await self._drive(
            _ops.settle(self._keys, scope, token, Status.COMPLETED, response, now, ttl)
        )

    async def fail(
        self, scope: Scope, token: int, response: bytes, *, now: datetime | None, ttl: timedelta
    ) -> None:
        await self._drive(_ops.settle(self._keys, scope, token, Status.FAILED, response, now, ttl))

    async def release(self, scope: Scope, token: int) -> None:
        await self._drive(_ops.release(self._keys, scope, token))

    async def renew(
        self, scope: Scope, token: int, *, now: datetime | None, lease: timedelta
    ) -> None:
        await self._drive(_ops.renew(self._keys, scope, token, now, lease))

    async def checkpoint(
        self, scope: Scope, token: int, point: str | None, *, now: datetime | None, lease: timedelta
    ) -> None:
        await self._drive(_ops.checkpoint(self._keys, scope, token, point, now, lease))

    async def get(self, scope: Scope) -> Record | None:
        return await self._drive(_ops.get(self._keys, scope))

    async def wait_settled(self, scope: Scope, seconds: float) -> None:
        """`RedisStore.wait_settled`, on this store's event loop."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        pubsub = self.client.pubsub()
        try:
            await pubsub.subscribe(self._keys.key(scope))
            if not _confirmed(await pubsub.get_message(timeout=seconds)):
                return
            if not await self._drive(_ops.mark(self._keys, scope)):
                return
            while (left := deadline - loop.time()) > 0:
                message = await pubsub.get_message(timeout=left)
                if message is not None and message["type"] == "message":
                    return
        except Exception:  # noqa: BLE001 - a failure only ends the wait (see the sync face)
            return
        finally:
            await pubsub.aclose()  # type: ignore[no-untyped-call,unused-ignore]  # typed from redis 8.2

    async def evict(self, scope: Scope) -> bool:
        return await self._drive(_ops.evict(self._keys, scope))

    async def purge(self, *, before: datetime | None = None, limit: int = 1000) -> int:
        return await self._drive(_ops.purge(self._keys, self._place, before, limit, self._cluster))

    async def stats(self) -> dict[str, int]:
        """How many records are in each state (a SCAN over the prefix)."""
        return await self._drive(_ops.stats(self._keys, self._cluster))

    async def scan(
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
        return await self._drive(_ops.scan(self._keys, where, self._cluster))

    async def aclose(self) -> None:
        await self._drain()
        if self._lane is not None:
            await self._lane.aclose()
        if self._owned:
            await self.client.aclose()
