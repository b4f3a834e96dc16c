"""Recovery points: work made of steps records each one and a takeover resumes after it.

The store verb (`checkpoint`) is in the store contract; here is the function API on every
store, sync and async: what a step records, what a retry inherits, the release that keeps the
steps, fencing, and the refusals. On the SQL stores, leased mode on the app's connection
commits a step's own writes with its record. The SIGKILL crash points are in
test_recovery_crashes.py.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from helpers import Database, new_key
from idempo import (
    AsyncIdempotency,
    ConfigurationError,
    FencedError,
    FingerprintMismatchError,
    Idempotency,
    Policy,
    Scope,
    UnserializableResultError,
)
from idempo._core.progress import MAX_POINT_BYTES, Progress
from idempo.saga import AsyncSaga, Saga
from idempo.stores.memory import MemoryStore
from idempo.testing import FakeClock

STEPS = ("reserve-stock", "charge", "notify")
LEASE = timedelta(seconds=30)


class Boom(Exception):
    """A transient failure in the middle of the work."""


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(datetime(2026, 6, 1, tzinfo=UTC))


def policy(clock: FakeClock) -> Policy:
    return Policy(lease=LEASE, clock=clock)


def order(idem: Idempotency, key: str, done: list[str], *, fail_at: str | None = None) -> Any:
    """Three steps, each recorded; ``fail_at`` raises inside that step, before its record."""
    with idem.once(key, operation="place-order", payload={"order": 7}) as attempt:
        if attempt.replayed:
            return attempt.result
        for step in STEPS:
            if attempt.needs(step):
                done.append(step)
                if step == fail_at:
                    raise Boom(step)
                attempt.checkpoint(step, {step: len(done)})
        attempt.result = {"state": dict(attempt.state), "resumed": attempt.resumed}
    return attempt.result


def test_a_transient_failure_keeps_the_steps_and_the_retry_resumes(
    node_store: Any, clock: FakeClock
) -> None:
    idem, key, done = Idempotency(node_store, policy=policy(clock)), new_key(), []
    with pytest.raises(Boom):
        order(idem, key, done, fail_at="charge")

    record = node_store.get(Scope.of(key, operation="place-order"))
    assert record is not None
    assert Progress.decode(record.recovery_point).steps == ("reserve-stock",)
    assert record.lease_expires_at is not None
    assert record.lease_expires_at <= clock()  # ended at once: the retry need not wait

    result = order(idem, key, done)  # no time passes
    assert done == ["reserve-stock", "charge", "charge", "notify"]
    assert result == {
        "state": {"reserve-stock": 1, "charge": 3, "notify": 4},
        "resumed": True,
    }
    assert order(idem, key, done) == result  # a replay runs nothing
    assert len(done) == 4


def test_a_takeover_after_the_lease_resumes_with_the_state(
    node_store: Any, clock: FakeClock
) -> None:
    """A holder that stopped (a crash: no release) leaves its steps; after the lease the
    retry inherits them, and the stale holder can record nothing more."""
    idem, key = Idempotency(node_store, policy=policy(clock)), new_key()
    stale = idem.begin(key, operation="place-order", payload={"order": 7})
    stale.attempt.checkpoint("reserve-stock", {"hold": "h-1"})

    clock.advance(LEASE)
    with idem.once(key, operation="place-order", payload={"order": 7}) as attempt:
        assert (attempt.resumed, attempt.steps, dict(attempt.state)) == (
            True,
            ("reserve-stock",),
            {"hold": "h-1"},
        )
        assert attempt.recovery_point == "reserve-stock"
        assert not attempt.needs("reserve-stock")
        assert attempt.needs("charge")
        with pytest.raises(FencedError):
            stale.attempt.checkpoint("charge")
        assert stale.attempt.lease_lost
        attempt.checkpoint("charge", {"charge": "ch-1"})
        attempt.result = dict(attempt.state)
    assert attempt.result == {"hold": "h-1", "charge": "ch-1"}
    with pytest.raises(FencedError):
        stale.finish("too late")


def test_a_different_payload_is_refused_while_steps_are_kept(
    node_store: Any, clock: FakeClock
) -> None:
    """The kept record still belongs to its request: another payload under the key is a
    mismatch, never a fresh run that would repeat the committed steps."""
    idem, key = Idempotency(node_store, policy=policy(clock)), new_key()
    with pytest.raises(Boom):
        order(idem, key, [], fail_at="charge")
    with (
        pytest.raises(FingerprintMismatchError),
        idem.once(key, operation="place-order", payload={"order": 8}),
    ):
        pass


@pytest.mark.anyio
async def test_async_steps_resume(async_node_store: Any, clock: FakeClock) -> None:
    idem, key, done = AsyncIdempotency(async_node_store, policy=policy(clock)), new_key(), []

    async def run(fail_at: str | None = None) -> Any:
        async with idem.once(key, operation="place-order", payload={"order": 7}) as attempt:
            for step in STEPS:
                if attempt.needs(step):
                    done.append(step)
                    if step == fail_at:
                        raise Boom(step)
                    await attempt.checkpoint(step, {step: True})
            attempt.result = list(attempt.steps)
        return attempt.result

    with pytest.raises(Boom):
        await run(fail_at="notify")
    assert await run() == list(STEPS)
    assert done == ["reserve-stock", "charge", "notify", "notify"]


def test_a_step_recorded_again_keeps_its_place() -> None:
    progress = Progress().after("a", {"x": 1}).after("b").after("a", {"x": 2})
    assert (progress.steps, dict(progress.state), progress.last) == (("a", "b"), {"x": 2}, "b")


def test_a_point_written_as_plain_text_is_one_step() -> None:
    """A recovery point is the name of the last step (SPEC §5): one another program or an
    operator wrote as plain text reads as that step, with no state."""
    for text in ("charged", '"charged"', "[1, 2]", '{"steps": "x"}'):
        assert Progress.decode(text) == Progress((text,), {}, resumed=True)
    assert Progress.decode('{"steps": ["a"], "state": 3}') == Progress(("a",), {}, resumed=True)


def test_bad_steps_and_states_are_refused_and_record_nothing(clock: FakeClock) -> None:
    store = MemoryStore()
    idem, key = Idempotency(store, policy=policy(clock)), new_key()
    scope = Scope.of(key, operation="op")
    with idem.once(key, operation="op") as attempt:
        with pytest.raises(ConfigurationError, match="step name"):
            attempt.checkpoint("")
        with pytest.raises(ConfigurationError, match="step name"):
            attempt.checkpoint("x" * 101)
        with pytest.raises(UnserializableResultError, match="JSON"):
            attempt.checkpoint("a", {"when": datetime.now(UTC)})
        with pytest.raises(UnserializableResultError, match="limit"):
            attempt.checkpoint("a", {"blob": "x" * MAX_POINT_BYTES})
        assert attempt.steps == ()
        record = store.get(scope)
        assert record is not None
        assert record.recovery_point is None
        attempt.result = "ok"


def test_a_replayed_attempt_records_no_steps(clock: FakeClock) -> None:
    idem, key = Idempotency(MemoryStore(), policy=policy(clock)), new_key()
    with idem.once(key, operation="op") as attempt:
        attempt.result = 1
    with idem.once(key, operation="op") as attempt:
        assert attempt.replayed
        with pytest.raises(ConfigurationError, match="replayed"):
            attempt.checkpoint("a")


def test_a_store_without_the_verb_says_so(clock: FakeClock) -> None:
    class Older:
        """A store written before recovery points: every verb but checkpoint."""

        def __init__(self) -> None:
            self.inner = MemoryStore()

        def __getattr__(self, name: str) -> Any:
            if name == "checkpoint":
                raise AttributeError(name)
            return getattr(self.inner, name)

    idem = Idempotency(Older(), policy=policy(clock))  # type: ignore[arg-type]
    with idem.once(new_key(), operation="op") as attempt:
        with pytest.raises(ConfigurationError, match="Older cannot record recovery points"):
            attempt.checkpoint("a")
        attempt.result = "still works"


def test_downstream_keys_are_per_scope_and_stable() -> None:
    idem = Idempotency(MemoryStore())
    keys = []
    for principal in ("alice", "bob", "alice"):
        handle = idem.begin("k", operation="op", principal=principal)
        keys.append(handle.attempt.downstream_key("charge"))
        handle.abort(Boom())
    assert keys[0] == keys[2] != keys[1]
    handle = idem.begin("k", operation="other", principal="alice")
    assert handle.attempt.downstream_key("charge") != keys[0]
    assert handle.attempt.downstream_key("mail") != handle.attempt.downstream_key("charge")


# -- on the app's connection (SQL): a step's writes commit with its record --------------------


def _count(database: Database, step: str) -> int:
    return int(
        database.select(f"SELECT count(*) FROM {database.business_table} WHERE step = ?", (step,))[
            0
        ][0]
    )


def test_a_steps_writes_commit_with_its_record(database: Database, clock: FakeClock) -> None:
    """Leased mode on the app's connection: each checkpoint commits the step's writes and
    its point together; a failure inside the next step rolls back only that step."""
    database.migrate()
    database.create_business_table("step VARCHAR(40)")
    store = database.store()
    conn = database.connect(store)
    idem, key = Idempotency(store, policy=policy(clock)), new_key()
    insert = database.sql(f"INSERT INTO {database.business_table} (step) VALUES (?)")

    def run(fail_at: str | None = None) -> Any:
        with idem.once(key, operation="order", conn=conn, mode="leased") as attempt:
            if attempt.replayed:
                return attempt.result
            for step in STEPS:
                if attempt.needs(step):
                    conn.execute(insert, (step,))
                    if step == fail_at:
                        raise Boom(step)
                    attempt.checkpoint(step)
            conn.execute(insert, ("result",))
            attempt.result = list(attempt.steps)
        return attempt.result

    try:
        with pytest.raises(Boom):
            run(fail_at="charge")
        assert [_count(database, step) for step in STEPS] == [1, 0, 0]
        record = store.get(Scope.of(key, operation="order"))
        assert record is not None
        assert Progress.decode(record.recovery_point).steps == ("reserve-stock",)

        assert run() == list(STEPS)
        assert [_count(database, s) for s in (*STEPS, "result")] == [1, 1, 1, 1]
        assert run() == list(STEPS)  # replayed
        assert _count(database, "result") == 1
    finally:
        conn.close()
        store.close()


def test_a_stale_holders_step_rolls_back(database: Database, clock: FakeClock) -> None:
    """Fencing reaches the step's own writes: the stale holder's checkpoint is refused inside
    its transaction, which rolls back, and the new holder's point stays."""
    database.migrate()
    database.create_business_table("step VARCHAR(40)")
    store = database.store()
    stale_conn, conn = database.connect(store), database.connect(store)
    idem, key = Idempotency(store, policy=policy(clock)), new_key()
    insert = database.sql(f"INSERT INTO {database.business_table} (step) VALUES (?)")
    try:
        stale = idem.begin(key, operation="order", conn=stale_conn, mode="leased")
        clock.advance(LEASE)
        with idem.once(key, operation="order", conn=conn, mode="leased") as attempt:
            conn.execute(insert, ("new",))
            attempt.checkpoint("reserve-stock", {"by": "new"})
            stale_conn.execute(insert, ("stale",))
            with pytest.raises(FencedError):
                stale.attempt.checkpoint("reserve-stock", {"by": "stale"})
            attempt.result = "done"
        with pytest.raises(FencedError):
            stale.finish("too late")
        assert (_count(database, "new"), _count(database, "stale")) == (1, 0)
        record = store.get(Scope.of(key, operation="order"))
        assert record is not None
        assert json.loads(record.recovery_point or "{}")["state"] == {"by": "new"}
    finally:
        stale_conn.close()
        conn.close()
        store.close()


def test_transactional_mode_refuses_steps(database: Database, clock: FakeClock) -> None:
    """Everything commits at the end in transactional mode: a crash leaves no step to resume,
    so a checkpoint is a configuration error, and the key is free again afterwards."""
    database.migrate()
    store = database.store()
    conn = database.connect(store)
    idem, key = Idempotency(store, policy=policy(clock)), new_key()
    try:
        with (
            pytest.raises(ConfigurationError, match="leased mode"),
            idem.once(key, operation="order", conn=conn) as attempt,
        ):
            attempt.checkpoint("reserve-stock")
        assert store.get(Scope.of(key, operation="order")) is None
    finally:
        conn.close()
        store.close()


# -- sagas ---------------------------------------------------------------------------------


def test_a_saga_step_can_record_steps_of_its_own(clock: FakeClock) -> None:
    """Each saga step is a record of its own, so a redelivered saga skips the steps that
    ran; a step made of phases records them through `Saga.once`."""
    saga = Saga(Idempotency(MemoryStore(), policy=policy(clock)), "order-9", name="fulfil")
    done: list[str] = []

    def ship(fail: bool) -> Any:
        with saga.once("ship", {"order": 9}) as attempt:
            assert attempt.scope.key == "order-9:ship"
            if attempt.replayed:
                return attempt.result
            for phase in ("pack", "label"):
                if attempt.needs(phase):
                    done.append(phase)
                    if fail and phase == "label":
                        raise Boom(phase)
                    attempt.checkpoint(phase)
            attempt.result = list(attempt.steps)
        return attempt.result

    with pytest.raises(Boom):
        ship(fail=True)
    assert ship(fail=False) == ["pack", "label"]
    assert done == ["pack", "label", "label"]
    assert saga.step("ship", lambda _: "not run", {"order": 9}) == ["pack", "label"]


@pytest.mark.anyio
async def test_an_async_saga_step_can_record_steps_of_its_own(clock: FakeClock) -> None:
    from idempo.stores.memory import AsyncMemoryStore

    saga = AsyncSaga(AsyncIdempotency(AsyncMemoryStore(), policy=policy(clock)), "order-9")
    async with saga.once("ship", {"order": 9}) as attempt:
        await attempt.checkpoint("pack")
        attempt.result = list(attempt.steps)

    async def not_run(_: Any) -> str:
        return "not run"

    assert await saga.step("ship", not_run, {"order": 9}) == ["pack"]


# -- the surfaces: HTTP handlers and consumers reach the same attempt -------------------------


@pytest.mark.anyio
async def test_an_http_handler_resumes_after_a_5xx(clock: FakeClock) -> None:
    """The ASGI middleware hands the handler its attempt: a step recorded before a 503 is
    not run again by the client's retry, which gets the completed answer."""
    import httpx

    from idempo.asgi import ATTEMPT_SCOPE_KEY, IdempotencyMiddleware
    from idempo.stores.memory import AsyncMemoryStore

    charges: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        attempt = scope[ATTEMPT_SCOPE_KEY]
        if attempt.needs("charge"):
            charges.append(attempt.downstream_key("charge"))
            await attempt.checkpoint("charge", {"charge_id": f"ch-{len(charges)}"})
        status, body = 201, json.dumps(dict(attempt.state)).encode()
        if len(charges) == 1 and not attempt.resumed:
            status, body = 503, b"the mailer is down"  # after the charge: transient
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": body})

    idem = AsyncIdempotency(AsyncMemoryStore(), policy=policy(clock))
    transport = httpx.ASGITransport(app=IdempotencyMiddleware(app, idempotency=idem))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        headers = {"Idempotency-Key": "pay-1"}
        answers = [await client.post("/pay", json={"amount": 5}, headers=headers) for _ in "abc"]
    assert [a.status_code for a in answers] == [503, 201, 201]
    assert answers[1].json() == {"charge_id": "ch-1"}
    assert answers[2].headers["idempotent-replayed"] == "true"
    assert len(charges) == 1


def test_a_consumer_resumes_a_redelivered_message(clock: FakeClock) -> None:
    from idempo.consumer import Consumer, Delivery, Envelope

    idem = Idempotency(MemoryStore(), policy=policy(clock))
    consumer: Consumer[None] = Consumer(idem, name="fulfil", horizon=timedelta(0))
    effects: list[str] = []

    def handle(delivery: Delivery[None]) -> str:
        attempt = delivery.attempt
        for step in ("pack", "ship"):
            if attempt.needs(step):
                effects.append(step)
                if step == "ship" and effects.count("ship") == 1:
                    raise Boom("the carrier timed out")
                attempt.checkpoint(step)
        return "shipped"

    outcomes = [consumer.process(None, Envelope("e-1", b"{}"), handle) for _ in "abc"]
    assert [o.action.value for o in outcomes] == ["requeue", "ack", "ack"]
    assert effects == ["pack", "ship", "ship"]


@pytest.mark.anyio
@pytest.mark.postgres
async def test_async_steps_on_the_apps_connection(
    postgres_database: Database, clock: FakeClock
) -> None:
    """psycopg's AsyncConnection, leased mode: the same commits per step as the sync face."""
    import psycopg

    db = postgres_database
    db.create_business_table("step VARCHAR(40)")
    store = db.async_store()
    conn = await psycopg.AsyncConnection.connect(db.location)
    idem, key = AsyncIdempotency(store, policy=policy(clock)), new_key()
    insert = db.sql(f"INSERT INTO {db.business_table} (step) VALUES (?)")

    async def run(fail_at: str | None = None) -> Any:
        async with idem.once(key, operation="order", conn=conn, mode="leased") as attempt:
            if attempt.replayed:
                return attempt.result
            for step in STEPS:
                if attempt.needs(step):
                    await conn.execute(insert, (step,))
                    if step == fail_at:
                        raise Boom(step)
                    await attempt.checkpoint(step)
            attempt.result = list(attempt.steps)
        return attempt.result

    try:
        with pytest.raises(Boom):
            await run(fail_at="notify")
        assert [_count(db, step) for step in STEPS] == [1, 1, 0]
        assert await run() == list(STEPS)
        assert [_count(db, step) for step in STEPS] == [1, 1, 1]
    finally:
        await conn.close()
        await store.aclose()


def test_a_checkpoint_whose_answer_was_lost_is_not_forgotten(clock: FakeClock) -> None:
    """The store recorded the step but the answer never came back (a connection lost after
    the commit): the failure that follows ends the lease with the point the record has, and
    the retry does not run that step again."""
    from idempo import StoreUnavailableError

    class LosesAnswers:
        def __init__(self) -> None:
            self.inner = MemoryStore()

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

        def checkpoint(self, *args: Any, **kwargs: Any) -> None:
            self.inner.checkpoint(*args, **kwargs)
            raise StoreUnavailableError("the connection broke before the answer")

    store = LosesAnswers()
    idem, key, done = Idempotency(store, policy=policy(clock)), new_key(), []  # type: ignore[arg-type]
    with pytest.raises(StoreUnavailableError):
        order(idem, key, done)
    assert done == ["reserve-stock"]
    store.checkpoint = store.inner.checkpoint  # type: ignore[method-assign]
    assert order(idem, key, done)["resumed"] is True
    assert done == ["reserve-stock", "charge", "notify"]
