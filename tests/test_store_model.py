"""The store contract as a state machine: every store's answers against the SPEC §2 model.

Three holders interleave reservations (same or another payload), completions, failures,
repeated settles, releases and renewals on three scopes, with purges, evictions, raw deletes
(what Redis's expiry or an operator does) and clock steps in between. The clock is the
model's: every verb gets an explicit ``now`` (an injected clock, SPEC §2 rule 9), moved by
fixed steps or to the exact instant a lease or retention ends (and one microsecond before).
`model.reference.ReferenceStore` predicts each answer; after every step each scope's stored
record must equal the model's, field for field.

What this catches: a takeover of a live lease, a stale token accepted (or a live one refused),
a replay or mismatch that is wrong or carries another record, a token that does not grow past
every earlier one of its scope (deleted records' included, SPEC §2 rule 8), a repeated settle
refused or changing the record (decision 3), a purge that deletes a record inside its
retention or under a live lease (or keeps one it should delete), an eviction that reports
wrongly, retention and lease times off by any amount.

Each store and face starts every example from a fresh table, file or prefix
(`model.backends`). Bounded for ``make test``: IDEMPO_MODEL_EXAMPLES examples (default 30) of
IDEMPO_MODEL_STEPS steps (default 25) per store and face; raise both to search harder, e.g.
``IDEMPO_MODEL_EXAMPLES=1000 IDEMPO_MODEL_STEPS=60 pytest tests/test_store_model.py``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, ClassVar

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from idempo import FencedError, Scope, Status
from idempo._core.record import Acquired, InProgress, Mismatch, Record, Replay
from model.backends import Backend
from model.reference import Acquire, ReferenceStore

EXAMPLES = int(os.environ.get("IDEMPO_MODEL_EXAMPLES", "30"))
STEPS = int(os.environ.get("IDEMPO_MODEL_STEPS", "25"))

T0 = datetime(2026, 1, 1, tzinfo=UTC)
US = timedelta(microseconds=1)
HOLDERS = 3
SCOPES = [
    Scope("alice", "charge", "k1"),
    Scope("alice", "charge", "k2"),
    Scope("bob", "charge", "k1"),  # the same key under another principal: its own record
]
FINGERPRINTS = ["fp-a", "fp-b"]
RESPONSES = [b"ok", b"", b"\x00declined\xff"]
LEASES = [timedelta(seconds=10), timedelta(seconds=30)]
TTLS = [timedelta(seconds=20), timedelta(minutes=2)]
STEPS_OF_CLOCK = [US, timedelta(seconds=1), timedelta(seconds=10), timedelta(minutes=1)]

holders = st.integers(0, HOLDERS - 1)
# Most steps on one scope, so that holders meet there; the others keep scopes apart honest.
scopes = st.sampled_from(SCOPES[:1]) | st.sampled_from(SCOPES)
fingerprints = st.sampled_from(FINGERPRINTS[:1]) | st.sampled_from(FINGERPRINTS)
settled_statuses = st.sampled_from([Status.COMPLETED, Status.FAILED])

Held = tuple[int, Scope]  # a holder and the scope it reserved


class StoreMachine(RuleBasedStateMachine):
    """One example: a fresh store, the model, the clock and what each holder believes."""

    backend: ClassVar[Backend]

    def __init__(self) -> None:
        super().__init__()
        self.fresh = self.backend.fresh()
        self.store = self.fresh.store
        self.model = ReferenceStore()
        self.now = T0
        # The last token each holder acquired per scope (kept after it goes stale: a stalled
        # holder keeps trying), and the last settle each one had accepted (to repeat it).
        self.tokens: dict[Held, int] = {}
        self.settles: dict[Held, tuple[int, Status, bytes]] = {}

    def teardown(self) -> None:
        self.fresh.close()

    # -- reservation -----------------------------------------------------------------------
    @rule(
        holder=holders,
        scope=scopes,
        fingerprint=fingerprints,
        lease=st.sampled_from(LEASES),
        ttl=st.sampled_from(TTLS),
    )
    def reserve(
        self, holder: int, scope: Scope, fingerprint: str, lease: timedelta, ttl: timedelta
    ) -> None:
        expected = self.model.expect_reserve(scope, fingerprint, self.now)
        taking_over = isinstance(expected, Acquire) and scope in self.model.records
        event(f"reserve: {'takeover' if taking_over else getattr(expected, 'kind', 'fresh')}")
        got = self.store.reserve(scope, fingerprint, now=self.now, lease=lease, ttl=ttl)
        if isinstance(expected, Acquire):
            assert isinstance(got, Acquired), f"the key is free at {self.now}, yet: {got}"
            assert got.recovery_point is None
            self.model.acquired(scope, fingerprint, got.token, now=self.now, lease=lease, ttl=ttl)
            self.tokens[holder, scope] = got.token
        elif expected.kind == "in_progress":
            assert isinstance(got, InProgress), f"a live lease is held, yet: {got}"
            assert got.retry_after == pytest.approx(expected.retry_after, abs=0.0011)
        else:
            kind = Replay if expected.kind == "replay" else Mismatch
            assert isinstance(got, kind), f"expected a {expected.kind}, got {got}"
            assert got.record == expected.record

    # -- the holders' fenced writes --------------------------------------------------------
    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), status=settled_statuses, response=st.sampled_from(RESPONSES))
    def settle(self, data: st.DataObject, status: Status, response: bytes) -> None:
        holder, scope = data.draw(st.sampled_from(list(self.tokens)), label="holder, scope")
        self._settle(holder, scope, self.tokens[holder, scope], status, response)

    @precondition(lambda self: self.settles)
    @rule(data=st.data())
    def settle_again(self, data: st.DataObject) -> None:
        """The same settle once more, as a command retried after a lost reply."""
        holder, scope = data.draw(st.sampled_from(list(self.settles)), label="holder, scope")
        self._settle(holder, scope, *self.settles[holder, scope])

    def _settle(
        self, holder: int, scope: Scope, token: int, status: Status, response: bytes
    ) -> None:
        ttl = TTLS[0]
        verb = self.store.complete if status is Status.COMPLETED else self.store.fail
        accepted = self.model.settle(scope, token, status, response, now=self.now, ttl=ttl)
        event(f"settle: {'accepted' if accepted else 'fenced'}")
        if accepted:
            verb(scope, token, response, now=self.now, ttl=ttl)
            self.settles[holder, scope] = (token, status, response)
        else:
            with pytest.raises(FencedError):
                verb(scope, token, response, now=self.now, ttl=ttl)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), lease=st.sampled_from(LEASES))
    def renew(self, data: st.DataObject, lease: timedelta) -> None:
        held = data.draw(st.sampled_from(list(self.tokens)), label="holder, scope")
        scope, token = held[1], self.tokens[held]
        if self.model.renew(scope, token, now=self.now, lease=lease):
            self.store.renew(scope, token, now=self.now, lease=lease)
        else:
            with pytest.raises(FencedError):
                self.store.renew(scope, token, now=self.now, lease=lease)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        held = data.draw(st.sampled_from(list(self.tokens)), label="holder, scope")
        self.model.release(held[1], self.tokens[held])
        self.store.release(held[1], self.tokens[held])

    # -- deletion ----------------------------------------------------------------------------
    @rule(
        limit=st.sampled_from([1, 2, 1000]),
        back=st.sampled_from([timedelta(0), US]),
        jump=st.sampled_from([None, 0, -1]),
    )
    def purge(self, limit: int, back: timedelta, jump: int | None) -> None:
        """Purge up to ``limit`` records whose retention ended by ``before`` (now, or just
        before it), after moving the clock to the next or the last deadline if ``jump``."""
        deadlines = self.model.deadlines(self.now)
        if jump is not None and deadlines:
            self.now = deadlines[jump]
        before = self.now - back
        candidates = self.model.purgeable(before)
        event(f"purge: {len(candidates)} candidates, limit {limit}")
        purged = self.store.purge(before=before, limit=limit)
        assert purged == min(limit, len(candidates)), (purged, limit, candidates)
        # Which of the candidates a bounded batch took is the store's choice; any other
        # record gone shows in the invariant below.
        gone = [s for s in SCOPES if s in candidates and self.store.get(s) is None]
        assert len(gone) == purged, (gone, purged)
        for scope in gone:
            self.model.delete(scope)

    @rule(scope=scopes)
    def evict(self, scope: Scope) -> None:
        existed = self.model.delete(scope)
        assert self.store.evict(scope) is existed

    @rule(scope=scopes)
    def delete_record(self, scope: Scope) -> None:
        """The record vanishes behind the store's back: Redis expiry, an operator's DELETE."""
        self.model.delete(scope)
        self.fresh.raw_delete(scope)

    # -- time and observation --------------------------------------------------------------
    @rule(step=st.sampled_from(STEPS_OF_CLOCK))
    def tick(self, step: timedelta) -> None:
        self.now += step

    @rule(which=st.integers(0, 3), early=st.booleans())
    def tick_to_deadline(self, which: int, early: bool) -> None:
        """To the instant a lease or retention ends, or the microsecond before it."""
        deadlines = self.model.deadlines(self.now)
        if deadlines:
            target = deadlines[which % len(deadlines)] - (US if early else timedelta(0))
            self.now = max(self.now, target)

    @rule()
    def stats(self) -> None:
        counts = {state: n for state, n in self.store.stats().items() if n}
        assert counts == self.model.stats()

    @invariant()
    def records_match_the_model(self) -> None:
        for scope in SCOPES:
            stored = self.store.get(scope)
            expected = self.model.records.get(scope)
            assert stored == expected, (
                f"{scope} at {self.now}:\n  store {stored}\n  model {expected}"
            )


KINDS: list[tuple[str, list[pytest.MarkDecorator]]] = [
    ("memory", []),
    ("sqlite", []),
    ("postgres", [pytest.mark.postgres]),
    ("mysql", [pytest.mark.mysql]),
    ("redis", [pytest.mark.redis]),
]
FACES = [
    pytest.param((kind, face), marks=marks, id=f"{kind}-{face}")
    for kind, marks in KINDS
    for face in ("sync", "async")
]


@pytest.fixture(params=FACES)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    """Fresh stores of one kind and face for every example, on the test's own schema,
    database, directory or prefixes."""
    kind, face = request.param
    url, where = "", ""
    if kind == "sqlite":
        where = str(tmp_path)
    elif kind == "postgres":
        url, where = request.getfixturevalue("postgres_url"), request.getfixturevalue("pg_schema")
    elif kind == "mysql":
        url, where = request.getfixturevalue("mysql_url"), request.getfixturevalue("mysql_db")
    elif kind == "redis":
        url = request.getfixturevalue("redis_url")
    made = Backend(kind, face == "async", url, where)
    try:
        yield made
    finally:
        made.close()


def test_store_answers_as_the_model_says(backend: Backend) -> None:
    """Every answer of every store, in both faces, is the one SPEC §2 gives."""
    machine: Any = type("Machine", (StoreMachine,), {"backend": backend})
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=STEPS,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
            print_blob=True,
        ),
    )


_TIMES = st.datetimes(timezones=st.just(UTC))


@given(
    st.tuples(
        st.builds(Scope, st.text(), st.text(), st.text()),
        st.text(),
        st.sampled_from(Status),
        st.integers(),
        st.none() | _TIMES,
        st.none() | st.binary(),
        _TIMES,
        _TIMES,
        _TIMES,
        st.none() | st.text(),
    )
)
def test_a_record_is_a_frozen_dataclass_of_its_fields(fields: tuple[Any, ...]) -> None:
    """`Record`'s own __init__ (it fills the slots, for speed) makes what the dataclass's would:
    its fields in order, equal and hashed as their tuple, the dataclass's repr, frozen."""
    import dataclasses

    made = Record(*fields)
    names = [field.name for field in dataclasses.fields(Record)]
    assert tuple(getattr(made, name) for name in names) == fields
    assert made == Record(*fields)
    assert hash(made) == hash(fields)
    shown = ", ".join(f"{name}={value!r}" for name, value in zip(names, fields, strict=True))
    assert repr(made) == f"Record({shown})"
    assert dataclasses.replace(made, token=0) == Record(*fields[:3], 0, *fields[4:])
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.token = 0  # type: ignore[misc]


@given(st.integers(), st.none() | st.text(), st.booleans())
def test_acquired_is_a_frozen_dataclass_of_its_fields(
    token: int, recovery_point: str | None, taken_over: bool
) -> None:
    """`Acquired`'s own __init__ (it fills the slots, for speed) makes what the dataclass's
    would, with its defaults: every store makes one per fresh call."""
    import dataclasses

    fields = (token, recovery_point, taken_over)
    made = Acquired(*fields)
    assert dataclasses.astuple(made) == fields
    assert made == Acquired(token=token, recovery_point=recovery_point, taken_over=taken_over)
    assert hash(made) == hash(fields)
    assert Acquired(token) == Acquired(token, None, False)
    assert repr(made) == (
        f"Acquired(token={token!r}, recovery_point={recovery_point!r}, taken_over={taken_over!r})"
    )
    assert dataclasses.replace(made, token=0) == Acquired(0, recovery_point, taken_over)
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.token = 0  # type: ignore[misc]
