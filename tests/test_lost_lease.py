"""A lost lease tells the work (issue 10, idemkit's vector), on the function API, every store.

A first holder's lease ends (the test's clock moves one lease on) and a second holder takes the
key over. The first's next background renewal (``once(..., renew_every=)``, the consumers'
automatic one) is refused: in async code the task running its work is cancelled, and leaving
the block raises `FencedError` instead, so the work never reaches its external call; in sync
code the attempt is marked (``attempt.lease_lost``) and its next ``renew()`` raises at once.
Either way the first holder leaves the second's reservation alone, and the second's result is
the one kept. A renewal
held at a gate (tests/faults.py) makes the order exact: it is sent only after the takeover.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from datetime import timedelta
from typing import Any

import pytest

from faults import STEP, Fault, Gate, Plan, VerbFaults
from idempo import AsyncIdempotency, FencedError, Idempotency, Policy, Scope, Status
from idempo.consumer import AsyncConsumer, Consumer, Delivery, Envelope, Reason
from idempo.stores.memory import AsyncMemoryStore, MemoryStore
from idempo.testing import FakeClock

OPERATION = "test.lease"
LEASE = timedelta(seconds=30)
EVERY = 0.001  # renew at once: the gate decides when the renewal reaches the store


def _eventually(condition: Any) -> bool:
    """A renewal thread's answer is marked on the attempt just after the store replies."""
    for _ in range(int(STEP / 0.001)):
        if condition():
            return True
        threading.Event().wait(0.001)
    return bool(condition())


@pytest.mark.anyio
async def test_a_lost_lease_cancels_the_async_work(async_node_store: Any, clock: FakeClock) -> None:
    gate = Gate(async_node_store, "renew", applied=False)
    idem = AsyncIdempotency(gate, Policy(clock=clock, lease=LEASE))
    scope = Scope.of("k-lost", operation=OPERATION)
    external: list[str] = []
    seen: dict[str, Any] = {}

    async def first() -> None:
        try:
            async with idem.once(scope.key, operation=OPERATION, renew_every=EVERY) as attempt:
                seen["attempt"] = attempt
                await asyncio.Event().wait()  # slow work, past its lease
                external.append("charged")  # what a lost lease must prevent
                attempt.result = "first"
        finally:
            seen["cancelling"] = asyncio.current_task().cancelling()  # type: ignore[union-attr]

    task = asyncio.get_running_loop().create_task(first())
    await asyncio.wait_for(gate.entered.wait(), STEP)  # its first renewal waits at the gate
    clock.advance(LEASE + timedelta(seconds=1))
    async with idem.once(scope.key, operation=OPERATION) as second:
        assert second.token > seen["attempt"].token, "the second holder took the key over"
        gate.opened.set()
        with pytest.raises(FencedError):
            await asyncio.wait_for(task, STEP)
        assert external == [], "the work went on after its lease was lost"
        assert seen["attempt"].lease_lost
        assert seen["cancelling"] == 0, "the lease's cancellation was not taken back"
        record = await async_node_store.get(scope)
        assert record is not None
        assert (record.status, record.token) == (Status.IN_PROGRESS, second.token)
        second.result = "second"
    async with idem.once(scope.key, operation=OPERATION) as replay:
        assert replay.replayed
        assert replay.result == "second"


@pytest.mark.anyio
async def test_a_lost_lease_and_another_cancellation_leave_the_other_one(
    clock: FakeClock,
) -> None:
    """The work cancelled for its lease and by its caller (a server shutting down): the
    caller's cancellation propagates, not a `FencedError` in its place."""
    store = AsyncMemoryStore()
    gate = Gate(store, "renew", applied=False)
    idem = AsyncIdempotency(gate, Policy(clock=clock, lease=LEASE))

    async def first() -> None:
        async with idem.once("k-both", operation=OPERATION, renew_every=EVERY):
            await asyncio.Event().wait()

    task = asyncio.get_running_loop().create_task(first())
    await asyncio.wait_for(gate.entered.wait(), STEP)
    clock.advance(LEASE + timedelta(seconds=1))
    async with idem.once("k-both", operation=OPERATION) as second:
        gate.opened.set()
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, STEP)
        second.result = "second"


@pytest.mark.anyio
async def test_a_store_fault_in_a_renewal_does_not_stop_the_work(clock: FakeClock) -> None:
    """A failed renewal is no lost lease: the work goes on, unmarked, and completes."""
    plan = Plan()
    idem = AsyncIdempotency(
        VerbFaults(AsyncMemoryStore(), plan, asynchronous=True), Policy(clock=clock, lease=LEASE)
    )
    warned = asyncio.Event()
    handler = _Signal(warned)
    logging.getLogger("idempo").addHandler(handler)
    try:
        plan.arm(1, Fault.RAISE)  # reserve, then the renewal
        async with idem.once("k-fault", operation=OPERATION, renew_every=EVERY) as attempt:
            await asyncio.wait_for(warned.wait(), STEP)
            assert plan.hit == "renew"
            assert not attempt.lease_lost
            attempt.result = "done"
    finally:
        logging.getLogger("idempo").removeHandler(handler)
    async with idem.once("k-fault", operation=OPERATION) as replay:
        assert replay.result == "done"


class _Signal(logging.Handler):
    def __init__(self, event: asyncio.Event) -> None:
        super().__init__(logging.WARNING)
        self._event = event

    def emit(self, record: logging.LogRecord) -> None:
        self._event.set()


class SyncGate:
    """The synchronous twin of `Gate`, on ``renew``: holds the first renewal until opened."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.entered = threading.Event()
        self.opened = threading.Event()
        self.answered = threading.Event()
        self.renewals = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def renew(self, *args: Any, **kwargs: Any) -> None:
        self.renewals += 1
        if self.renewals == 1:
            self.entered.set()
            assert self.opened.wait(STEP)
        try:
            self._store.renew(*args, **kwargs)
        finally:
            self.answered.set()


def test_a_lost_lease_marks_the_sync_work(node_store: Any, clock: FakeClock) -> None:
    gate = SyncGate(node_store)
    idem = Idempotency(gate, Policy(clock=clock, lease=LEASE))
    scope = Scope.of("k-lost", operation=OPERATION)
    taking_over = idem.once(scope.key, operation=OPERATION)
    holders: dict[str, Any] = {}

    def first_holder() -> None:
        with idem.once(scope.key, operation=OPERATION, renew_every=EVERY) as first:
            assert gate.entered.wait(STEP)  # the renewal thread waits at the gate
            clock.advance(LEASE + timedelta(seconds=1))
            second = holders["second"] = taking_over.__enter__()
            assert second.token is not None
            assert first.token is not None
            assert second.token > first.token
            gate.opened.set()
            assert gate.answered.wait(STEP)
            assert _eventually(lambda: first.lease_lost)
            with pytest.raises(FencedError):
                first.renew()  # the checkpoint: refused at once
            assert gate.renewals == 1, "the checkpoint made a round trip"
            first.result = "first"  # and its outcome is refused on leaving

    with pytest.raises(FencedError):
        first_holder()
    second = holders["second"]
    record = node_store.get(scope)
    assert record is not None
    assert (record.status, record.token) == (Status.IN_PROGRESS, second.token)
    second.result = "second"
    taking_over.__exit__(None, None, None)
    with idem.once(scope.key, operation=OPERATION) as replay:
        assert replay.replayed
        assert replay.result == "second"


@pytest.mark.anyio
async def test_a_lost_lease_over_asgi_answers_409_and_keeps_the_takers_record(
    clock: FakeClock,
) -> None:
    """The ASGI middleware's renewal is refused after a takeover: the handler is cancelled
    before its external call and the client gets a 409 ``lease-lost`` problem, not a dropped
    connection; the taker's reservation is left alone."""
    import httpx

    from idempo.asgi import IdempotencyMiddleware

    store = AsyncMemoryStore()
    gate = Gate(store, "renew", applied=False)
    external: list[str] = []
    entered = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        entered.set()
        await asyncio.Event().wait()  # slow work, past its lease
        external.append("charged")

    mw = IdempotencyMiddleware(
        app, idempotency=AsyncIdempotency(gate, Policy(clock=clock, lease=LEASE))
    )
    mw.renew_every = EVERY
    transport = httpx.ASGITransport(app=mw)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        first = asyncio.get_running_loop().create_task(
            client.post("/items", content=b"{}", headers={"Idempotency-Key": "k-asgi"})
        )
        await asyncio.wait_for(entered.wait(), STEP)
        await asyncio.wait_for(gate.entered.wait(), STEP)
        clock.advance(LEASE + timedelta(seconds=1))
        scope = Scope.of("k-asgi", operation="POST /items")
        held = await store.get(scope)
        assert held is not None
        taken = await store.reserve(
            scope, held.fingerprint, now=clock(), lease=LEASE, ttl=timedelta(hours=1)
        )
        assert taken.token > held.token  # type: ignore[union-attr]
        gate.opened.set()
        answer = await asyncio.wait_for(first, STEP)
    assert answer.status_code == 409
    assert answer.headers["content-type"] == "application/problem+json"
    assert answer.json()["type"].endswith("lease-lost")
    assert external == []
    record = await store.get(scope)
    assert record is not None
    assert (record.status, record.token) == (Status.IN_PROGRESS, taken.token)  # type: ignore[union-attr]


SHORT = timedelta(milliseconds=30)  # consumers renew every lease / 3: 10 ms of real time


@pytest.mark.anyio
async def test_a_lost_lease_requeues_the_async_consumers_message(
    async_node_store: Any, clock: FakeClock
) -> None:
    """The consumer's automatic renewal is refused after a takeover: the handler is cancelled
    before its external call and the message is requeued as FENCED, not raised out of the
    consumer as a cancellation; the taker's reservation is left alone."""
    gate = Gate(async_node_store, "renew", applied=False)
    idem = AsyncIdempotency(gate, Policy(clock=clock, lease=SHORT))
    consumer: AsyncConsumer[None] = AsyncConsumer(idem, name=OPERATION, horizon=timedelta(0))
    external: list[str] = []

    async def handle(delivery: Delivery[None]) -> str:
        await asyncio.Event().wait()  # slow work, past its lease
        external.append("charged")
        return "first"

    envelope = Envelope("e-lost", b"{}")
    processing = asyncio.get_running_loop().create_task(consumer.process(None, envelope, handle))
    await asyncio.wait_for(gate.entered.wait(), STEP)
    clock.advance(timedelta(seconds=1))
    scope = Scope.of("e-lost", operation=OPERATION)
    held = await async_node_store.get(scope)
    assert held is not None
    taken = await async_node_store.reserve(
        scope, held.fingerprint, now=clock(), lease=LEASE, ttl=timedelta(hours=1)
    )
    assert taken.token > held.token
    gate.opened.set()
    outcome = await asyncio.wait_for(processing, STEP)
    assert (outcome.reason, outcome.action.value) == (Reason.FENCED, "requeue")
    assert isinstance(outcome.error, FencedError)
    assert external == []
    record = await async_node_store.get(scope)
    assert record is not None
    assert (record.status, record.token) == (Status.IN_PROGRESS, taken.token)


def test_a_lost_lease_reaches_the_sync_consumers_handler(clock: FakeClock) -> None:
    """A sync handler learns at its checkpoint (``delivery.attempt.renew()``) and the message
    is requeued as FENCED."""
    store = MemoryStore()
    gate = SyncGate(store)
    idem = Idempotency(gate, Policy(clock=clock, lease=SHORT))
    consumer: Consumer[None] = Consumer(idem, name=OPERATION, horizon=timedelta(0))
    scope = Scope.of("e-sync", operation=OPERATION)
    external: list[str] = []

    def handle(delivery: Delivery[None]) -> str:
        assert gate.entered.wait(STEP)
        clock.advance(timedelta(seconds=1))
        held = store.get(scope)
        assert held is not None
        store.reserve(scope, held.fingerprint, now=clock(), lease=LEASE, ttl=timedelta(hours=1))
        gate.opened.set()
        assert gate.answered.wait(STEP)
        assert _eventually(lambda: delivery.attempt.lease_lost)
        delivery.attempt.renew()  # the checkpoint before the external call raises
        external.append("charged")
        return "first"

    outcome = consumer.process(None, Envelope("e-sync", b"{}"), handle)
    assert (outcome.reason, outcome.action.value) == (Reason.FENCED, "requeue")
    assert external == []
    record = store.get(scope)
    assert record is not None
    assert record.status is Status.IN_PROGRESS


def test_renew_every_must_be_shorter_than_the_lease() -> None:
    from idempo import ConfigurationError

    idem = Idempotency(MemoryStore(), Policy(lease=LEASE))
    for bad in (0, -1.0, LEASE, LEASE.total_seconds() + 1):
        with pytest.raises(ConfigurationError, match="renew_every"):
            idem.once("k", operation=OPERATION, renew_every=bad)
