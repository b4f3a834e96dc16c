"""Saga steps: each step of an orchestrated saga runs once per ``saga_id:step``.

An orchestrator that handles one message per saga event calls its steps through a saga; when
the message is redelivered (a crash between two steps, a redrive), the steps that already ran
replay their stored results and only the rest execute::

    async def on_order_placed(delivery: Delivery[Any]) -> None:
        order = json.loads(delivery.envelope.body)
        saga = AsyncSaga(idem, order["id"], name="fulfilment")
        stock = await saga.step("reserve-stock", inventory.reserve, order)
        await saga.step("charge", psp.charge, {"order": order["id"], "amount": order["total"]})

Each step is a record of its own, keyed `step_key` ``(saga_id, step)`` under the operation
``name``. It commits by itself on the store's own connections (or on ``conn=``, which it then
owns like any guarded call), never inside a consumer's transaction: a step's effect lives in
another system, and that system should get a key derived from the step's (`derive_key`).

.. versionadded:: 0.1
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from typing import Any, TypeVar

from ._core.keys import step_key, validate_key
from .guard import AsyncAttempt, AsyncIdempotency, Attempt, Idempotency
from .serializers import return_serializer
from .stores.base import Mode

__all__ = ["AsyncSaga", "Saga"]

P = TypeVar("P")
R = TypeVar("R")


class _Saga:
    """What both twins know: the saga's id, name and principal."""

    def __init__(
        self,
        idempotency: AsyncIdempotency | Idempotency,
        saga_id: str,
        *,
        name: str = "saga",
        principal: str = "",
    ) -> None:
        self.idempotency = idempotency
        self.saga_id = validate_key(saga_id)
        self.name = name
        self.principal = principal

    def _once_args(
        self, step: str, fn: Callable[..., Any] | None, payload: Any, conn: Any, mode: Mode
    ) -> dict[str, Any]:
        args = {
            "key": step_key(self.saga_id, step),
            "operation": self.name,
            "payload": payload,
            "principal": self.principal,
            "conn": conn,
            "mode": mode,
        }
        if fn is not None:
            args["serializer"] = return_serializer(fn)
        return args


class AsyncSaga(_Saga):
    """The steps of one saga instance, each run once (async).

    Args:
        idempotency: the guard the step records go through.
        saga_id: the saga instance's id (an order id, the triggering event's id); a valid key.
        name: the saga's name, the operation its step records are scoped to. Give the same
            name wherever the same saga's steps run (every consumer of its events).
        principal: the rest of the scope (a tenant).

    >>> import asyncio
    >>> from idempo.stores.memory import AsyncMemoryStore
    >>> saga = AsyncSaga(AsyncIdempotency(AsyncMemoryStore()), "order-7", name="fulfilment")
    >>> calls = []
    >>> async def reserve(order: dict) -> str:
    ...     calls.append(order)
    ...     return "rsv-1"
    >>> async def run():
    ...     return [await saga.step("reserve-stock", reserve, {"sku": "a"}) for _ in range(2)]
    >>> asyncio.run(run()), len(calls)
    (['rsv-1', 'rsv-1'], 1)
    """

    idempotency: AsyncIdempotency

    async def step(
        self,
        step: str,
        fn: Callable[[P], Awaitable[R]],
        payload: P,
        *,
        conn: Any = None,
        mode: Mode = "transactional",
    ) -> R:
        """Run ``await fn(payload)`` once for this saga's ``step``; later calls replay its result.

        Args:
            step: the step's name (printable ASCII, no spaces or ``:``).
            fn: the step's work, called with ``payload``.
            payload: what the step is given; fingerprinted, so calling the same step again
                with other data raises `FingerprintMismatchError`.
            conn: run the step's record in this connection's transaction (see ``once``).
            mode: with ``conn``: ``"transactional"`` or ``"leased"``.

        Raises:
            RequestInProgressError: the step is running elsewhere right now.
            ReplayedFailureError: the step failed deterministically before (``fail_on``).
        """
        async with self.idempotency.once(**self._once_args(step, fn, payload, conn, mode)) as a:
            if not a.replayed:
                a.result = await fn(payload)
        result: R = a.result
        return result

    def once(
        self, step: str, payload: Any, *, conn: Any = None, mode: Mode = "transactional"
    ) -> AbstractAsyncContextManager[AsyncAttempt[Any]]:
        """The guarded block of ``step`` itself, for a step made of phases that records each
        one (``await attempt.checkpoint(phase)``, leased mode) and resumes after the last
        on redelivery; ``async with saga.once("ship", order) as attempt:``. The result is
        what `step` of the same name replays."""
        return self.idempotency.once(**self._once_args(step, None, payload, conn, mode))


class Saga(_Saga):
    """The synchronous twin of `AsyncSaga`.

    >>> from idempo.stores.memory import MemoryStore
    >>> saga = Saga(Idempotency(MemoryStore()), "order-7")
    >>> [saga.step("ship", lambda order: {"parcel": order["id"]}, {"id": 7}) for _ in "ab"]
    [{'parcel': 7}, {'parcel': 7}]
    """

    idempotency: Idempotency

    def step(
        self,
        step: str,
        fn: Callable[[P], R],
        payload: P,
        *,
        conn: Any = None,
        mode: Mode = "transactional",
    ) -> R:
        """Run ``fn(payload)`` once for this saga's ``step``; later calls replay its result."""
        with self.idempotency.once(**self._once_args(step, fn, payload, conn, mode)) as a:
            if not a.replayed:
                a.result = fn(payload)
        result: R = a.result
        return result

    def once(
        self, step: str, payload: Any, *, conn: Any = None, mode: Mode = "transactional"
    ) -> AbstractContextManager[Attempt[Any]]:
        """The guarded block of ``step`` itself; see `AsyncSaga.once`."""
        return self.idempotency.once(**self._once_args(step, None, payload, conn, mode))
