"""The record protocol of SPEC §2, checked in every interleaving within bounds.

`model.protocol` is the protocol as a transition system (reserve, takeover, complete/fail and
their repeat, release, renew, a purge that picks and later deletes, expiry, eviction, clock
ticks; several holders with what each believes); `explore` visits every reachable state
breadth first and checks the SPEC §2 invariants on every transition. The deliberately broken
variants prove the checker can fail: each known bug is found, with its shortest trace.

Bounds for ``make test`` keep this module to a few seconds. Search larger spaces with
IDEMPO_PROTOCOL_BOUNDS, e.g. ``IDEMPO_PROTOCOL_BOUNDS=holders=3,max_time=8,max_token=6``
(fields of `model.protocol.Bounds`; a third holder sends another payload), which takes
minutes.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import pytest

from model.protocol import IN_PROGRESS, Bounds, Result, State, Variant, describe, explore

SMALL = [
    pytest.param(Bounds(holders=2, fingerprints=(0, 0), max_time=6, max_token=5), id="2-holders"),
    pytest.param(Bounds(holders=3, max_time=5, max_token=4), id="3-holders-2-payloads"),
]


def _bounds_from_env() -> list[Any]:
    text = os.environ.get("IDEMPO_PROTOCOL_BOUNDS")
    if not text:
        return SMALL
    fields = dict(item.split("=", 1) for item in text.split(","))
    numbers: dict[str, Any] = {name: int(value) for name, value in fields.items()}
    bounds = replace(Bounds(), **numbers)
    if bounds.holders != len(bounds.fingerprints):
        bounds = replace(bounds, fingerprints=(0,) * (bounds.holders - 1) + (1,))
    return [pytest.param(bounds, id=text)]


def _witnessed(result: Result) -> dict[str, bool]:
    """Situations the invariants are about, each reached somewhere (else the check is
    vacuous: it would pass a protocol that never gets into trouble)."""

    def stale_holder(s: State) -> bool:
        return any(h.holding and (s.rec is None or s.rec.token != h.token) for h in s.holders)

    def purge_overtaken(s: State) -> bool:
        rec = s.rec
        return (
            s.pending is not None
            and rec is not None
            and rec.state == IN_PROGRESS
            and rec.lease_end > s.pending
        )

    def settle_repeatable(s: State) -> bool:
        rec = s.rec
        return rec is not None and any(
            h.settled == rec.state and h.token == rec.token for h in s.holders
        )

    def deleted_after_tokens(s: State) -> bool:
        return s.rec is None and s.highest >= 2

    checks = [stale_holder, purge_overtaken, settle_repeatable, deleted_after_tokens]
    return {check.__name__: any(check(s) for s in result.seen) for check in checks}


@pytest.mark.parametrize("bounds", _bounds_from_env())
def test_the_protocol_keeps_every_invariant(bounds: Bounds) -> None:
    """No interleaving within the bounds breaks a SPEC §2 invariant."""
    result = explore(bounds)
    print(f"\n{bounds}: {describe(result)}")
    assert result.violation is None, describe(result)
    every_kind = {"tick", "reserve", "settle", "settle-again", "release", "renew"}
    every_kind |= {"purge-pick", "purge-delete", "expire", "evict"}
    assert set(result.actions) == every_kind, result.actions
    assert all(_witnessed(result).values()), _witnessed(result)


BUGS = [
    pytest.param(Variant(tokens_restart=True), {"token-grows"}, id="tokens-restart-at-1"),
    pytest.param(
        # With the token check off, what a reused token does: a stale holder's settle or
        # release lands on the new holder's reservation.
        Variant(tokens_restart=True, check_tokens=False),
        {"fenced-settle", "fenced-release"},
        id="tokens-restart-at-1-harm",
    ),
    pytest.param(Variant(purge_by_key=True), {"purge-safe"}, id="purge-does-not-look-again"),
    pytest.param(
        Variant(renew_keeps_retention=True),
        {"single-live-holder", "purge-safe", "holder-not-lost"},
        id="renew-keeps-retention",
    ),
    pytest.param(Variant(release_unfenced=True), {"fenced-release"}, id="release-unfenced"),
]


@pytest.mark.parametrize(("variant", "broken"), BUGS)
def test_the_explorer_finds_each_known_bug(variant: Variant, broken: set[str]) -> None:
    """Each deliberately broken protocol is caught, with a short trace to the violation."""
    result = explore(Bounds(holders=2, fingerprints=(0, 0), max_time=6, max_token=5), variant)
    print(f"\n{variant}: {describe(result)}")
    assert result.violation is not None, f"{variant} passed: {describe(result)}"
    assert result.violation.invariant in broken, describe(result)
    assert len(result.violation.trace) <= 10
