"""The store contract, as a test class a store's own test suite subclasses.

Every store idempo ships passes it, against the real server, sync and async; so must yours.
Subclass `StoreContract` in a pytest file and give it a ``store`` fixture that returns (or
yields) a fresh, migrated, empty store, synchronous or asynchronous::

    import pytest
    from idempo.testing import StoreContract

    from mystore import AsyncMyStore, MyStore


    class TestMyStore(StoreContract):
        @pytest.fixture(params=["sync", "async"])
        def store(self, request):
            return MyStore() if request.param == "sync" else AsyncMyStore()

Every contract test then runs once per store the fixture gives. The tests are async (they
need pytest and anyio's pytest plugin, which ``pip install anyio`` brings); a synchronous
store is driven through `Threaded`, each verb in a worker thread (as an app serving requests
from threads would), so both faces answer to the same assertions. Time comes from the
class's ``clock`` fixture (a `FakeClock`): the tests pass ``now`` to every verb, except the
one that checks ``now=None`` means the store's own clock. Importing this module imports
pytest; ``import idempo.testing`` alone does not.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import anyio.to_thread
import pytest

from .._core.keys import Scope
from .._core.record import Acquired, InProgress, Mismatch, Record, Replay, Reservation, Status
from ..errors import ConfigurationError, FencedError
from ..stores.base import AsyncStore, Store
from . import FakeClock

__all__ = ["LEASE", "TTL", "Harness", "StoreContract", "Threaded"]

LEASE = timedelta(seconds=30)
TTL = timedelta(hours=1)
TICK = timedelta(microseconds=1)


class Threaded:
    """A synchronous store seen through awaited verbs, each run in a worker thread."""

    def __init__(self, store: Any) -> None:
        self.sync = store

    def __getattr__(self, name: str) -> Callable[..., Awaitable[Any]]:
        verb = getattr(self.sync, name)

        async def call(*args: Any, **kwargs: Any) -> Any:
            return await anyio.to_thread.run_sync(functools.partial(verb, *args, **kwargs))

        return call


class Harness:
    """Store verbs with the test clock's ``now`` and the default lease and retention.

    ``store`` is the store under test behind awaited verbs (a sync one through `Threaded`).
    """

    def __init__(self, store: Any, clock: FakeClock) -> None:
        self.store = store
        self.clock = clock

    async def reserve(
        self, scope: Scope, fp: str, *, lease: timedelta = LEASE, ttl: timedelta = TTL
    ) -> Reservation:
        result: Reservation = await self.store.reserve(
            scope, fp, now=self.clock(), lease=lease, ttl=ttl
        )
        return result

    async def acquire(
        self, scope: Scope, fp: str, *, lease: timedelta = LEASE, ttl: timedelta = TTL
    ) -> int:
        reservation = await self.reserve(scope, fp, lease=lease, ttl=ttl)
        assert isinstance(reservation, Acquired), reservation
        return reservation.token

    async def complete(
        self, scope: Scope, token: int, body: bytes, *, ttl: timedelta = TTL
    ) -> None:
        await self.store.complete(scope, token, body, now=self.clock(), ttl=ttl)

    async def fail(self, scope: Scope, token: int, body: bytes, *, ttl: timedelta = TTL) -> None:
        await self.store.fail(scope, token, body, now=self.clock(), ttl=ttl)

    async def renew(self, scope: Scope, token: int, *, lease: timedelta = LEASE) -> None:
        await self.store.renew(scope, token, now=self.clock(), lease=lease)

    async def checkpoint(
        self, scope: Scope, token: int, point: str | None, *, lease: timedelta = LEASE
    ) -> None:
        if not hasattr(self.store, "checkpoint") and not hasattr(
            getattr(self.store, "sync", None), "checkpoint"
        ):
            pytest.skip("the store records no recovery points (it has no checkpoint verb)")
        await self.store.checkpoint(scope, token, point, now=self.clock(), lease=lease)

    async def scan(self, **filters: Any) -> list[Record]:
        """The store's optional listing verb; skips the test for a store without it."""
        if not hasattr(self.store, "scan") and not hasattr(
            getattr(self.store, "sync", None), "scan"
        ):
            pytest.skip("the store lists no records (it has no scan verb)")
        found: list[Record] = await self.store.scan(**filters)
        return found


def scope(key: str = "k-1", *, operation: str = "charge", principal: str = "alice") -> Scope:
    return Scope.of(key, operation=operation, principal=principal)


async def check_fenced_out(h: Harness, token: int, body: bytes) -> None:
    """``token`` can neither complete with ``body``, fail with it nor renew; then it releases
    the scope (what that leaves is for the caller to check)."""
    with pytest.raises(FencedError):
        await h.complete(scope(), token, body)
    with pytest.raises(FencedError):
        await h.fail(scope(), token, body)
    with pytest.raises(FencedError):
        await h.renew(scope(), token)
    await h.store.release(scope(), token)


class StoreContract:
    """**Subclass me:** the store contract, one async test per rule a store must keep.

    A subclass gives a ``store`` fixture (a fresh, migrated, empty store, sync or async); it
    may override ``clock`` (the `FakeClock` the tests drive) and ``anyio_backend``
    (``"asyncio"``). The tests reach the store through the ``h`` fixture, a `Harness`.
    """

    pytestmark = pytest.mark.anyio

    @pytest.fixture
    def store(self) -> Any:
        """The store under test: a subclass gives it."""
        raise NotImplementedError(
            f"{type(self).__name__} must give a `store` fixture: a fresh, migrated, empty store"
        )

    @pytest.fixture
    def clock(self) -> FakeClock:
        """A clock that moves only when a test says so."""
        return FakeClock(datetime(2026, 1, 1, tzinfo=UTC))

    @pytest.fixture
    def anyio_backend(self) -> str:
        """The event loop the tests run on."""
        return "asyncio"

    @pytest.fixture
    def h(self, store: Any, clock: FakeClock) -> Harness:
        """The store under test behind awaited verbs, driven with the test's clock."""
        is_async = inspect.iscoroutinefunction(getattr(store, "reserve", None))
        return Harness(store if is_async else Threaded(store), clock)

    # -- shape -------------------------------------------------------------------------------

    async def test_the_store_has_every_verb_of_its_protocol(self, store: Any) -> None:
        """A sync store is a `Store`; an async one an `AsyncStore` whose verbs are all
        awaited (a sync verb among them would block the event loop)."""
        if not inspect.iscoroutinefunction(getattr(store, "reserve", None)):
            assert isinstance(store, Store), f"{type(store).__name__} lacks verbs of Store"
            return
        assert isinstance(store, AsyncStore), f"{type(store).__name__} lacks verbs of AsyncStore"
        verbs = [name for name in dir(AsyncStore) if not name.startswith("_")]
        blocking = [name for name in verbs if not inspect.iscoroutinefunction(getattr(store, name))]
        assert not blocking, f"{type(store).__name__}: not async: {', '.join(blocking)}"

    # -- reservation -------------------------------------------------------------------------

    async def test_fresh_reserve_acquires_a_token(self, h: Harness) -> None:
        """The first reservation of a scope acquires it with a positive token (which value is the
        store's: tokens only have to grow) and no recovery point."""
        reservation = await h.reserve(scope(), "fp")
        assert isinstance(reservation, Acquired)
        assert reservation.token > 0
        assert reservation.recovery_point is None

    async def test_duplicate_during_live_lease_is_in_progress(self, h: Harness) -> None:
        """A duplicate while the lease is live is told to come back when the lease ends."""
        token = await h.acquire(scope(), "fp")
        h.clock.advance(seconds=10)

        verdict = await h.reserve(scope(), "fp")

        assert isinstance(verdict, InProgress)
        assert verdict.retry_after == pytest.approx(20.0, abs=0.01)
        record = await h.store.get(scope())
        assert record is not None
        assert (record.status, record.token) == (Status.IN_PROGRESS, token)

    async def test_completed_record_replays_byte_identical_response(self, h: Harness) -> None:
        """A retry after completion replays the stored response, byte for byte, every time."""
        body = bytes(range(256)) * 3 + b"\x00\r\n"
        token = await h.acquire(scope(), "fp")
        await h.complete(scope(), token, body)

        for _ in range(2):
            verdict = await h.reserve(scope(), "fp")
            assert isinstance(verdict, Replay)
            assert verdict.record.status is Status.COMPLETED
            assert verdict.record.response == body
            assert verdict.record.token == token

    async def test_failed_record_replays_the_failure(self, h: Harness) -> None:
        """A deterministic failure is stored as FAILED and replayed with its response."""
        token = await h.acquire(scope(), "fp")
        await h.fail(scope(), token, b'{"error":"declined"}')

        verdict = await h.reserve(scope(), "fp")

        assert isinstance(verdict, Replay)
        assert verdict.record.status is Status.FAILED
        assert verdict.record.response == b'{"error":"declined"}'

    async def test_other_fingerprint_after_completion_is_a_mismatch(self, h: Harness) -> None:
        """The same key with another payload after completion is refused, never replayed."""
        token = await h.acquire(scope(), "fp")
        await h.complete(scope(), token, b"first")

        verdict = await h.reserve(scope(), "other-fp")

        assert isinstance(verdict, Mismatch)
        assert verdict.record.fingerprint == "fp"
        record = await h.store.get(scope())
        assert record is not None
        assert (record.status, record.response, record.fingerprint) == (
            Status.COMPLETED,
            b"first",
            "fp",
        )

    async def test_other_fingerprint_while_in_progress_is_a_mismatch(self, h: Harness) -> None:
        """Another payload is a mismatch during a live lease and after it, never a takeover."""
        token = await h.acquire(scope(), "fp")
        assert isinstance(await h.reserve(scope(), "other-fp"), Mismatch)

        h.clock.advance(LEASE + timedelta(seconds=1))
        assert isinstance(await h.reserve(scope(), "other-fp"), Mismatch)

        record = await h.store.get(scope())
        assert record is not None
        assert (record.fingerprint, record.token) == ("fp", token)

    # -- leases and fencing --------------------------------------------------------------------

    async def test_expired_lease_is_taken_over_with_the_next_token(self, h: Harness) -> None:
        """A duplicate is refused until the lease's last instant and takes over from then on,
        with a larger token each time."""
        first = await h.acquire(scope(), "fp")
        created = h.clock()

        h.clock.advance(LEASE - TICK)
        assert isinstance(await h.reserve(scope(), "fp"), InProgress)

        h.clock.advance(TICK)
        second = await h.acquire(scope(), "fp")
        assert second > first

        record = await h.store.get(scope())
        assert record is not None
        assert (record.status, record.token) == (Status.IN_PROGRESS, second)
        assert record.lease_expires_at == h.clock() + LEASE
        assert record.created_at == created  # still the same intent
        assert record.updated_at == h.clock()

        h.clock.advance(LEASE)
        assert await h.acquire(scope(), "fp") > second

    async def test_stale_holder_is_fenced_out(self, h: Harness) -> None:
        """After a takeover the old token can neither complete, fail nor renew, and its release
        leaves the new holder's reservation alone."""
        old = await h.acquire(scope(), "fp")
        h.clock.advance(LEASE)
        new = await h.acquire(scope(), "fp")
        assert new > old

        await check_fenced_out(h, old, b"zombie")

        record = await h.store.get(scope())
        assert record is not None
        assert (record.status, record.token, record.response) == (Status.IN_PROGRESS, new, None)

        await h.complete(scope(), new, b"winner")
        verdict = await h.reserve(scope(), "fp")
        assert isinstance(verdict, Replay)
        assert verdict.record.response == b"winner"

    async def test_settled_record_refuses_further_writes(self, h: Harness) -> None:
        """Once completed, the holder's own token can no longer settle or renew, and its
        release does not delete the completed record."""
        token = await h.acquire(scope(), "fp")
        await h.complete(scope(), token, b"done")

        await check_fenced_out(h, token, b"again")

        record = await h.store.get(scope())
        assert record is not None
        assert (record.status, record.response) == (Status.COMPLETED, b"done")

    @pytest.mark.parametrize("settle", ["complete", "fail"])
    async def test_repeated_settle_is_retry_safe(self, h: Harness, settle: str) -> None:
        """Settling again with the same token, status and response (a retried command whose
        reply was lost) succeeds and changes nothing, even later; another status or another
        response by that token is fenced."""
        token = await h.acquire(scope(), "fp")
        await getattr(h, settle)(scope(), token, b"answer")
        first = await h.store.get(scope())
        h.clock.advance(seconds=5)

        await getattr(h, settle)(scope(), token, b"answer")

        assert await h.store.get(scope()) == first
        other = "fail" if settle == "complete" else "complete"
        with pytest.raises(FencedError):
            await getattr(h, other)(scope(), token, b"answer")
        with pytest.raises(FencedError):
            await getattr(h, settle)(scope(), token, b"another answer")
        assert await h.store.get(scope()) == first

    async def test_verbs_on_an_unknown_scope(self, h: Harness) -> None:
        """A scope never reserved has no record; settling or renewing it is fenced, releasing
        it does nothing."""
        assert await h.store.get(scope()) is None
        with pytest.raises(FencedError):
            await h.complete(scope(), 1, b"x")
        with pytest.raises(FencedError):
            await h.renew(scope(), 1)
        await h.store.release(scope(), 1)
        assert await h.store.get(scope()) is None

    async def test_renew_extends_the_lease(self, h: Harness) -> None:
        """A renewed lease keeps duplicates out past the end of the original lease."""
        lease = timedelta(seconds=10)
        token = await h.acquire(scope(), "fp", lease=lease)
        h.clock.advance(seconds=8)
        await h.renew(scope(), token, lease=lease)  # now until t=18

        h.clock.advance(seconds=7)  # t=15: the original lease ended at t=10
        verdict = await h.reserve(scope(), "fp", lease=lease)
        assert isinstance(verdict, InProgress)
        assert verdict.retry_after == pytest.approx(3.0, abs=0.01)

        record = await h.store.get(scope())
        assert record is not None
        assert record.token == token
        assert record.lease_expires_at == h.clock() + timedelta(seconds=3)

        h.clock.advance(seconds=3)
        assert await h.acquire(scope(), "fp", lease=lease) > token

    async def test_release_frees_the_key(self, h: Harness) -> None:
        """A released key is gone: a retry executes again, with any payload."""
        token = await h.acquire(scope(), "fp")
        await h.store.release(scope(), token)
        assert await h.store.get(scope()) is None

        assert isinstance(await h.reserve(scope(), "fp"), Acquired)
        again = await h.store.get(scope())
        assert again is not None
        await h.store.release(scope(), again.token)

        assert isinstance(await h.reserve(scope(), "other-fp"), Acquired)
        record = await h.store.get(scope())
        assert record is not None
        assert (record.status, record.fingerprint) == (Status.IN_PROGRESS, "other-fp")

    # -- recovery points (an optional verb: `checkpoint`) ---------------------------------------

    async def test_checkpoint_records_the_point_and_extends_the_lease(self, h: Harness) -> None:
        """A checkpoint keeps the point on the record and moves the lease, as a renewal does;
        a takeover after the lease hands the point to the next holder."""
        token = await h.acquire(scope(), "fp")
        h.clock.advance(seconds=20)
        await h.checkpoint(scope(), token, "reserved")  # until t=50
        record = await h.store.get(scope())
        assert record is not None
        assert (record.recovery_point, record.token) == ("reserved", token)
        assert record.lease_expires_at == h.clock() + LEASE

        h.clock.advance(seconds=25)  # t=45: the first lease ended at t=30
        assert isinstance(await h.reserve(scope(), "fp"), InProgress)
        h.clock.advance(seconds=5)
        taken = await h.reserve(scope(), "fp")
        assert isinstance(taken, Acquired)
        assert (taken.recovery_point, taken.token > token) == ("reserved", True)

    async def test_a_checkpoint_with_no_lease_frees_the_key_for_a_retry(self, h: Harness) -> None:
        """Lease zero ends the lease at once, and a point of None keeps the stored one: the
        retry of the same request takes over now and resumes; another payload is still a
        mismatch."""
        token = await h.acquire(scope(), "fp")
        await h.checkpoint(scope(), token, "charged")
        await h.checkpoint(scope(), token, None, lease=timedelta(0))
        assert isinstance(await h.reserve(scope(), "other-fp"), Mismatch)
        taken = await h.reserve(scope(), "fp")
        assert isinstance(taken, Acquired)
        assert taken.recovery_point == "charged"

    async def test_release_never_forgets_a_recovery_point(self, h: Harness) -> None:
        """The steps a point names committed: a release keeps the record (its lease ends by
        itself), so no retry runs them again from the start."""
        token = await h.acquire(scope(), "fp")
        await h.checkpoint(scope(), token, "charged")
        await h.store.release(scope(), token)
        record = await h.store.get(scope())
        assert record is not None
        assert (record.status, record.recovery_point) == (Status.IN_PROGRESS, "charged")

    async def test_a_stale_checkpoint_is_fenced(self, h: Harness) -> None:
        """After a takeover the old holder cannot record a step, nor after completion."""
        old = await h.acquire(scope(), "fp")
        await h.checkpoint(scope(), old, "one")
        h.clock.advance(LEASE)
        new = await h.acquire(scope(), "fp")
        with pytest.raises(FencedError):
            await h.checkpoint(scope(), old, "zombie")
        await h.checkpoint(scope(), new, "two")
        await h.complete(scope(), new, b"done")
        with pytest.raises(FencedError):
            await h.checkpoint(scope(), new, "late")
        record = await h.store.get(scope())
        assert record is not None
        assert (record.status, record.recovery_point) == (Status.COMPLETED, "two")
        with pytest.raises(FencedError):
            await h.checkpoint(Scope.of("never", operation="charge"), 1, "x")

    # -- retention -----------------------------------------------------------------------------

    @pytest.mark.parametrize("settle", ["complete", "fail"])
    async def test_record_past_retention_is_taken_over(self, h: Harness, settle: str) -> None:
        """A settled record replays until its retention ends; then the key is free for any
        payload, with a fresh history and a token that still fences the old holder."""
        ttl = timedelta(minutes=10)
        token = await h.acquire(scope(), "fp", ttl=ttl)
        await getattr(h, settle)(scope(), token, b"old", ttl=ttl)
        settled = await h.store.get(scope())
        assert settled is not None
        assert settled.expires_at >= h.clock() + ttl

        h.clock.advance(settled.expires_at - h.clock() - TICK)
        assert isinstance(await h.reserve(scope(), "fp"), Replay)
        assert isinstance(await h.reserve(scope(), "other-fp"), Mismatch)

        h.clock.advance(TICK)
        reservation = await h.reserve(scope(), "other-fp")
        assert isinstance(reservation, Acquired)
        assert reservation.token > token
        assert reservation.recovery_point is None

        record = await h.store.get(scope())
        assert record is not None
        assert (record.status, record.fingerprint, record.response) == (
            Status.IN_PROGRESS,
            "other-fp",
            None,
        )
        assert record.created_at == h.clock()
        with pytest.raises(FencedError):
            await h.complete(scope(), token, b"zombie")

    async def test_purge_deletes_expired_records_in_bounded_batches(self, h: Harness) -> None:
        """Purge deletes at most ``limit`` expired records per call, reports how many, and
        keeps live leases, expired leases still within retention and unexpired records."""
        short = timedelta(seconds=5)
        for i in range(4):
            token = await h.acquire(scope(f"done-{i}"), "fp", lease=short, ttl=short)
            await h.complete(scope(f"done-{i}"), token, b"r", ttl=short)
        token = await h.acquire(scope("failed"), "fp", lease=short, ttl=short)
        await h.fail(scope("failed"), token, b"r", ttl=short)
        await h.acquire(scope("abandoned"), "fp", lease=short, ttl=short)

        h.clock.advance(seconds=10)  # the six above are past retention
        await h.acquire(scope("live"), "fp", lease=timedelta(hours=2), ttl=timedelta(hours=2))
        await h.acquire(scope("lease-over"), "fp", lease=short, ttl=TTL)
        token = await h.acquire(scope("kept"), "fp")
        await h.complete(scope("kept"), token, b"r")
        h.clock.advance(seconds=10)  # "lease-over" lost its lease but keeps its retention

        counts = [await h.store.purge(before=h.clock(), limit=4) for _ in range(3)]

        assert counts == [4, 2, 0]
        for key in ("live", "lease-over", "kept"):
            assert await h.store.get(scope(key)) is not None, key
        for key in [f"done-{i}" for i in range(4)] + ["failed", "abandoned"]:
            assert await h.store.get(scope(key)) is None, key
        assert isinstance(await h.reserve(scope("live"), "fp"), InProgress)

    # -- scopes, records, responses ------------------------------------------------------------

    async def test_scopes_are_independent(self, h: Harness) -> None:
        """The same key under another principal or operation is a separate record."""
        mine = scope("shared", principal="alice", operation="charge")
        theirs = scope("shared", principal="bob", operation="charge")
        elsewhere = scope("shared", principal="alice", operation="refund")
        anonymous = scope("shared", principal="", operation="charge")

        tokens = [await h.acquire(s, f"fp-{i}") for i, s in enumerate([mine, theirs, elsewhere])]
        await h.complete(mine, tokens[0], b"alice's answer")

        assert isinstance(await h.reserve(theirs, "fp-1"), InProgress)
        assert isinstance(await h.reserve(elsewhere, "fp-0"), Mismatch)
        assert isinstance(await h.reserve(anonymous, "fp-0"), Acquired)
        verdict = await h.reserve(mine, "fp-0")
        assert isinstance(verdict, Replay)
        assert verdict.record.response == b"alice's answer"
        assert verdict.record.scope == mine

    async def test_retention_after_completion_is_at_least_the_ttl(self, h: Harness) -> None:
        """A record completed within its lease keeps its expiry from reservation, which is already
        at least ttl after completion; completing later moves the expiry to ttl after completion."""
        early, late = scope("early"), scope("late")
        early_token = await h.acquire(early, "fp")
        late_token = await h.acquire(late, "fp")
        reserved_at = h.clock()
        h.clock.advance(seconds=10)
        await h.complete(early, early_token, b"ok", ttl=TTL)
        early_record = await h.store.get(early)
        assert early_record is not None
        assert early_record.expires_at == reserved_at + LEASE + TTL
        assert early_record.expires_at >= h.clock() + TTL
        h.clock.advance(timedelta(hours=2))
        await h.store.renew(late, late_token, now=h.clock(), lease=LEASE)
        await h.complete(late, late_token, b"ok", ttl=TTL)
        late_record = await h.store.get(late)
        assert late_record is not None
        assert late_record.expires_at == h.clock() + TTL

    async def test_get_returns_the_stored_record(self, h: Harness) -> None:
        """get returns every field as stored, with aware UTC times, before and after completion."""
        s = scope("order-7", principal="tenant-1", operation="POST /payments")
        reserved_at = h.clock()
        token = await h.acquire(s, "f" * 64)

        record = await h.store.get(s)
        assert record is not None
        assert record.scope == s
        assert (record.fingerprint, record.status, record.token) == (
            "f" * 64,
            Status.IN_PROGRESS,
            token,
        )
        assert record.response is None
        assert record.lease_expires_at == reserved_at + LEASE
        assert record.created_at == record.updated_at == reserved_at
        assert record.expires_at == reserved_at + LEASE + TTL
        assert record.recovery_point is None

        h.clock.advance(seconds=3)
        await h.complete(s, token, b"201 created", ttl=timedelta(hours=5))

        record = await h.store.get(s)
        assert record is not None
        assert (record.status, record.token, record.response) == (
            Status.COMPLETED,
            token,
            b"201 created",
        )
        assert record.lease_expires_at is None
        assert record.created_at == reserved_at
        assert record.updated_at == h.clock()
        assert record.expires_at == h.clock() + timedelta(hours=5)
        for moment in (record.created_at, record.updated_at, record.expires_at):
            assert moment.utcoffset() == timedelta(0)

    @pytest.mark.parametrize(
        "body",
        [b"", os.urandom(512 * 1024)],
        ids=["empty", "512KiB"],
    )
    async def test_responses_round_trip(self, h: Harness, body: bytes) -> None:
        """Empty and large responses come back exactly as stored (empty is not "no response")."""
        token = await h.acquire(scope(), "fp")
        await h.complete(scope(), token, body)

        verdict = await h.reserve(scope(), "fp")
        assert isinstance(verdict, Replay)
        assert verdict.record.response is not None
        assert len(verdict.record.response) == len(body)
        assert verdict.record.response == body

    async def test_stats_count_records_per_state(self, h: Harness) -> None:
        """stats counts the records in each state and forgets released ones."""
        assert {k: v for k, v in (await h.store.stats()).items() if v} == {}
        tokens = {key: await h.acquire(scope(key), "fp") for key in ("a", "b", "c", "d")}
        await h.complete(scope("a"), tokens["a"], b"ok")
        await h.fail(scope("b"), tokens["b"], b"no")
        await h.store.release(scope("d"), tokens["d"])

        stats = await h.store.stats()

        assert {k: v for k, v in stats.items() if v} == {
            "in_progress": 1,
            "completed": 1,
            "failed": 1,
        }

    # -- listing (an optional verb: `scan`) ----------------------------------------------------

    async def test_scan_lists_records_by_every_filter(self, h: Harness) -> None:
        """scan returns the records that pass every filter given (state, operation, principal,
        created at or before an instant), oldest first, each as `get` has it but without its
        response; released records are gone from it."""
        t0 = h.clock()
        old = await h.acquire(scope("stuck", principal="alice"), "fp")
        h.clock.advance(timedelta(minutes=10))
        t1 = h.clock()
        done = await h.acquire(scope("done", principal="bob"), "fp")
        await h.complete(scope("done", principal="bob"), done, b"body")
        h.clock.advance(timedelta(minutes=1))
        await h.acquire(scope("fresh", operation="refund", principal="alice"), "fp")
        failed = await h.acquire(scope("bad", principal=""), "fp")
        await h.fail(scope("bad", principal=""), failed, b"no")
        gone = await h.acquire(scope("gone"), "fp")
        await h.store.release(scope("gone"), gone)

        def keys(records: list[Record]) -> list[str]:
            return [r.scope.key for r in records]

        everything = await h.scan()
        assert sorted(keys(everything)) == ["bad", "done", "fresh", "stuck"]
        assert keys(everything)[:2] == ["stuck", "done"]  # oldest first
        assert all(r.response is None for r in everything)
        (stuck,) = [r for r in everything if r.scope.key == "stuck"]
        whole = await h.store.get(scope("stuck", principal="alice"))
        assert whole is not None
        assert stuck == whole  # an in-progress record has no response to leave out
        assert (stuck.token, stuck.created_at, stuck.lease_expires_at) == (old, t0, t0 + LEASE)

        in_progress = await h.scan(status=Status.IN_PROGRESS)
        assert sorted(keys(in_progress)) == ["fresh", "stuck"]
        assert keys(await h.scan(status=Status.COMPLETED)) == ["done"]
        assert keys(await h.scan(status=Status.FAILED)) == ["bad"]
        assert keys(await h.scan(operation="refund")) == ["fresh"]
        assert sorted(keys(await h.scan(principal="alice"))) == ["fresh", "stuck"]
        assert keys(await h.scan(principal="")) == ["bad"]
        assert keys(await h.scan(created_before=t0)) == ["stuck"]
        assert keys(await h.scan(created_before=t1)) == ["stuck", "done"]
        stuck_for_5_min = await h.scan(
            status=Status.IN_PROGRESS, created_before=h.clock() - timedelta(minutes=5)
        )
        assert keys(stuck_for_5_min) == ["stuck"]
        assert await h.scan(status=Status.COMPLETED, principal="alice") == []
        assert await h.scan(operation="no-such-operation") == []

    async def test_scan_is_bounded_by_its_limit(self, h: Harness) -> None:
        """scan returns at most ``limit`` records, each passing the filters, and refuses a
        limit that is not 1 to 10000 before it reads anything."""
        for n in range(7):
            token = await h.acquire(scope(f"k{n}"), "fp")
            if n % 2:
                await h.complete(scope(f"k{n}"), token, b"ok")
        some = await h.scan(limit=3)
        assert len(some) == 3
        assert len({r.scope for r in some}) == 3
        settled = await h.scan(status=Status.COMPLETED, limit=2)
        assert len(settled) == 2
        assert all(r.status is Status.COMPLETED for r in settled)
        assert len(await h.scan(status=Status.COMPLETED, limit=10)) == 3
        for bad in (0, -1, 10_001):
            with pytest.raises(ConfigurationError):
                await h.scan(limit=bad)

    # -- whose clock (SPEC §2 rule 9) ----------------------------------------------------------

    async def test_no_time_given_means_the_store_clock(self, h: Harness) -> None:
        """With ``now=None`` (and ``purge(before=None)``) the store decides on its own clock, or
        the host's where it has none: a lease taken so is live to a second caller, the answer's
        wait is that clock's, and purge deletes only what that clock calls expired."""
        live, old = scope("live"), scope("old")
        first = await h.store.reserve(live, "fp", now=None, lease=LEASE, ttl=TTL)
        assert isinstance(first, Acquired)
        second = await h.store.reserve(live, "fp", now=None, lease=LEASE, ttl=TTL)
        assert isinstance(second, InProgress)
        assert 0 < second.retry_after <= LEASE.total_seconds()
        days_ago = datetime.now(UTC) - timedelta(days=3)
        expired = await h.store.reserve(old, "fp", now=days_ago, lease=LEASE, ttl=TTL)
        assert isinstance(expired, Acquired)
        await h.store.complete(live, first.token, b"ok", now=None, ttl=TTL)
        await h.store.complete(live, first.token, b"ok", now=None, ttl=TTL)  # retry-safe too

        assert await h.store.purge(before=None) == 1

        assert await h.store.get(old) is None
        replay = await h.store.reserve(live, "fp", now=None, lease=LEASE, ttl=TTL)
        assert isinstance(replay, Replay)
        assert replay.record.response == b"ok"

    # -- tokens are never reused (SPEC §2 rule 8) --------------------------------------------

    @pytest.mark.parametrize("deletion", ["evict", "purge", "release"])
    async def test_tokens_grow_across_the_deletion_of_the_record(
        self, h: Harness, deletion: str
    ) -> None:
        """A holder stalled past its record's deletion (evicted, purged after its retention, or
        released and made again) holds a token no later holder of the scope ever gets: it can
        neither release the new reservation nor settle or renew over it."""
        stale = await h.acquire(scope(), "fp", lease=TICK, ttl=TICK)
        if deletion == "evict":
            assert await h.store.evict(scope()) is True
            assert await h.store.evict(scope()) is False
        elif deletion == "purge":
            h.clock.advance(seconds=1)
            assert await h.store.purge(before=h.clock()) == 1
        else:
            await h.store.release(scope(), stale)
        assert await h.store.get(scope()) is None
        h.clock.advance(seconds=1)
        fresh = await h.acquire(scope(), "fp")
        assert fresh > stale
        await h.store.release(scope(), stale)
        record = await h.store.get(scope())
        assert record is not None, "the stale holder's release deleted the live reservation"
        assert (record.status, record.token) == (Status.IN_PROGRESS, fresh)
        with pytest.raises(FencedError):
            await h.complete(scope(), stale, b"stale")
        with pytest.raises(FencedError):
            await h.renew(scope(), stale)
        await h.complete(scope(), fresh, b"fresh")
        record = await h.store.get(scope())
        assert record is not None
        assert record.response == b"fresh"
