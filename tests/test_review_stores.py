"""Internal review: fencing tokens, leases, the cache tier and records, against the real
servers, through the public API only.

Each defect the review found was first a test marked ``xfail(strict=True)``; the mark came
off with its fix (docs/testing.md). The other tests are checks that held.
"""

from __future__ import annotations

import time
from contextlib import closing
from datetime import timedelta
from typing import Any

import pytest

from helpers import Database, new_key
from idempo import (
    CorruptRecordError,
    FencedError,
    Idempotency,
    Policy,
    Scope,
    Status,
    TransactionOwnershipError,
)

OPERATION = "review.stores"


class Transient(Exception):
    """A failure of the work that releases the key."""


def tokens_of_rolled_back_attempts(db: Database, n: int = 3) -> list[int]:
    """The tokens ``n`` transactional attempts on one key were handed, each rolled back by a
    transient failure of its work."""
    store = db.store()
    idem = Idempotency(store)
    key = new_key()
    seen: list[int] = []
    try:
        with closing(db.connect(store)) as conn:
            for _ in range(n):
                try:
                    with idem.once(key, operation=OPERATION, conn=conn) as attempt:
                        assert attempt.token is not None
                        seen.append(attempt.token)
                        raise Transient
                except Transient:
                    pass
    finally:
        store.close()
    return seen


@pytest.mark.parametrize(
    "kind",
    [
        pytest.param("sqlite"),
        pytest.param("postgres", marks=pytest.mark.postgres),
        pytest.param("mysql", marks=pytest.mark.mysql),
    ],
)
def test_tokens_grow_across_rolled_back_transactional_attempts(
    kind: str, request: pytest.FixtureRequest
) -> None:
    """SPEC §2 rule 8: a scope's fencing tokens only grow. Each attempt is handed its token
    (``attempt.token``), so the next attempt must get a larger one, even though the first
    attempt's transaction rolled back. PostgreSQL and MariaDB draw from a sequence, which no
    rollback moves back."""
    tokens = tokens_of_rolled_back_attempts(request.getfixturevalue(f"{kind}_database"))
    assert tokens == sorted(set(tokens)), tokens


@pytest.mark.parametrize(
    "kind",
    [
        pytest.param("sqlite"),
        pytest.param("postgres", marks=pytest.mark.postgres),
        pytest.param("mysql", marks=pytest.mark.mysql),
    ],
)
def test_rolled_back_block_never_settles_a_later_holders_reservation(
    kind: str, request: pytest.FixtureRequest
) -> None:
    """A transactional block that rolls the guard's transaction back (a misuse the guard
    must report: TransactionOwnershipError) while a leased attempt takes the now free key:
    the leased attempt's live reservation is its own, and its completion is stored.

    On SQLite both attempts hold token 1: the guard asks the store whether the record with
    its token is still IN_PROGRESS ("the app committed it"), finds the later holder's, and
    records FAILED on it."""
    db: Database = request.getfixturevalue(f"{kind}_database")
    store = db.store()
    idem = Idempotency(store)
    key = new_key()
    scope = Scope.of(key, operation=OPERATION)
    try:
        with closing(db.connect(store)) as conn:
            first = idem.once(key, operation=OPERATION, conn=conn)
            a = first.__enter__()
            conn.rollback()  # the app ends the guard's transaction: nothing of it is left
            second = idem.once(key, operation=OPERATION)  # leased, the store's connection
            b = second.__enter__()
            assert not b.replayed
            a.result = "first"
            with pytest.raises(TransactionOwnershipError):
                first.__exit__(None, None, None)
            b.result = "second"
            second.__exit__(None, None, None)  # today: FencedError
        record = store.get(scope)
        assert record is not None
        assert record.status is Status.COMPLETED
        assert record.response == b'"second"'
    finally:
        store.close()


def test_stale_release_after_purge_and_new_reservation_is_harmless(node_store: Any) -> None:
    """A check that held on every store: a holder stalled past its lease and the retention
    (its record purged, the key reserved again) cannot release the new reservation nor
    settle over it."""
    store = node_store
    idem = Idempotency(store, Policy(lease=timedelta(milliseconds=200), ttl=timedelta(seconds=1)))
    key = new_key()
    scope = Scope.of(key, operation=OPERATION)
    stale = idem.once(key, operation=OPERATION)
    old = stale.__enter__()
    time.sleep(1.4)
    store.purge()
    fresh = idem.once(key, operation=OPERATION)
    new = fresh.__enter__()
    assert new.token is not None
    assert old.token is not None
    assert new.token > old.token
    store.release(scope, old.token)  # a stale release is a no-op
    with pytest.raises(FencedError):
        store.complete(scope, old.token, b'"stale"', now=None, ttl=timedelta(seconds=1))
    record = store.get(scope)
    assert record is not None
    assert record.status is Status.IN_PROGRESS
    assert record.token == new.token
    new.result = "fresh"
    fresh.__exit__(None, None, None)
    old.result = "stale"
    with pytest.raises(FencedError):
        stale.__exit__(None, None, None)
    record = store.get(scope)
    assert record is not None
    assert record.response == b'"fresh"'


def test_in_progress_row_without_a_lease_is_corrupt(database: Database) -> None:
    """Issue 10: a stored record that cannot be decoded must be a typed error that says how to
    evict it. An in-progress record with no lease is one no store writes: nothing can take
    it over (no lease to expire) and no holder will settle it."""
    db = database
    store = db.store()
    idem = Idempotency(store)
    key = new_key()
    try:
        held = idem.once(key, operation=OPERATION)
        held.__enter__()  # reserved, never settled
        db.execute(f"UPDATE {db.records_table} SET lease_expires_at = NULL")
        with (
            pytest.raises(CorruptRecordError, match="evict"),
            idem.once(key, operation=OPERATION) as attempt,
        ):
            attempt.result = "ran"
    finally:
        store.close()
