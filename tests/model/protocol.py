"""The record protocol of SPEC §2 as a finite transition system, and an exhaustive explorer.

One scope, a few holders (attempts) and a purger act on one record with an integer clock.
Every action is one atomic store step, as the stores implement them: reserve (create, or
take over an expired lease or retention), complete/fail and their repeat, release, renew, the
two halves of a purge (it picks a record, then deletes it in a later step, as a statement
that chose its rows from an older snapshot does), the record expiring by itself (Redis's
TTL), an operator's eviction, and a clock tick. `explore` visits every state reachable
within the bounds (breadth first, each state once) and checks SPEC §2's invariants on every
transition; the first violation comes back with the shortest trace that reaches it.

Holders keep what an attempt knows: its token, whether it believes it holds the key, the
lease end it was granted, and the status of its last accepted settle (to repeat it). The
record keeps, besides the store's fields, a ghost field: which holder's reservation it is.
The explorer keeps another ghost, the largest token ever handed out, which survives every
deletion. `Variant` flags switch on known bugs, so a test can show the checker finds them.

Invariants (the names a violation carries):

``token-grows``        a token handed out is larger than every token the scope ever had
                       (SPEC §2 rule 8), deleted records' included;
``single-live-holder`` a reservation is never granted while another holder's lease, as it was
                       granted, is still live (unless an operator evicted that holder's record);
``fenced-settle``      a settle is accepted only from the holder whose reservation the record is;
``fenced-release``     a release deletes only its own holder's reservation;
``purge-safe``         purge (and expiry) never deletes a record inside its retention or under
                       a live lease (SPEC §2 rule 10);
``retention-kept``     a completed or failed record is replaced only after its retention;
``holder-not-lost``    a holder whose lease is live, and whose record no operator evicted, has
                       its settle or renewal accepted.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

IN_PROGRESS, COMPLETED, FAILED = "I", "C", "F"


class Rec(NamedTuple):
    state: str
    token: int
    lease_end: int  # meaningful while IN_PROGRESS
    expires: int
    owner: int  # ghost: the holder whose reservation this is
    response: int  # the settling holder's response (each holder answers its own)


class Action(NamedTuple):
    kind: str
    holder: int = -1
    status: str = ""

    def __str__(self) -> str:
        if self.holder < 0:
            return self.kind
        return f"{self.kind}({self.holder}{',' + self.status if self.status else ''})"


_TICK, _EXPIRE, _EVICT = Action("tick"), Action("expire"), Action("evict")
_PURGE_PICK, _PURGE_DELETE = Action("purge-pick"), Action("purge-delete")


class Holder(NamedTuple):
    token: int  # 0: none
    holding: bool  # believes it holds the key
    lease_end: int  # the lease end it was granted (while holding)
    settled: str  # status of its last accepted settle, "" if none
    evicted: bool  # an operator deleted its record while it held it


class State(NamedTuple):
    now: int
    rec: Rec | None
    counter: int  # the store's token source: the last token it handed out
    highest: int  # ghost: the largest token ever handed out
    pending: int | None  # a purge under way: the ``before`` it picked its record with
    holders: tuple[Holder, ...]


@dataclass(frozen=True)
class Variant:
    """The protocol as the SPEC says (all False), or with one known bug."""

    tokens_restart: bool = False  # a fresh record starts at token 1 (defect 3)
    purge_by_key: bool = False  # purge deletes what it picked without looking again (defect 1)
    renew_keeps_retention: bool = False  # a renewal does not extend the retention
    release_unfenced: bool = False  # release deletes whatever reservation is there
    check_tokens: bool = True  # check token-grows (off: see what a reused token leads to)


@dataclass(frozen=True)
class Bounds:
    holders: int = 3
    max_time: int = 6
    lease: int = 2
    retention: int = 2
    max_token: int = 5
    fingerprints: tuple[int, ...] = (0, 0, 1)  # the third holder sends another payload


@dataclass
class Violation:
    invariant: str
    detail: str
    trace: list[str]


@dataclass
class Result:
    states: int = 0
    transitions: int = 0
    depth: int = 0
    seconds: float = 0.0
    violation: Violation | None = None
    actions: dict[str, int] = field(default_factory=dict)  # transitions taken, per kind
    seen: set[State] = field(default_factory=set)  # every reachable state (canonical)


class _Violated(Exception):
    def __init__(self, invariant: str, detail: str) -> None:
        super().__init__(invariant, detail)
        self.invariant = invariant
        self.detail = detail


def _check(ok: bool, invariant: str, detail: str) -> None:
    if not ok:
        raise _Violated(invariant, detail)


def _idle() -> Holder:
    return Holder(0, False, 0, "", False)


def _stop(holder: Holder) -> Holder:
    """The holder no longer believes it holds; all it keeps is what a repeat needs."""
    if holder.settled:
        return Holder(holder.token, False, 0, holder.settled, False)
    return _idle()


class Protocol:
    """The transitions of one `Variant` within one `Bounds`."""

    def __init__(self, bounds: Bounds, variant: Variant) -> None:
        self.b = bounds
        self.v = variant

    def canonical(self, s: State) -> State:
        """``s`` with the holders that send the same payload in a fixed order: they are
        interchangeable, so states that differ only by their numbering are one state."""
        order = sorted(range(len(s.holders)), key=lambda h: (self.b.fingerprints[h], s.holders[h]))
        # Slot i of each payload's group gets the i-th holder of that group in sorted order.
        slots = sorted(range(len(s.holders)), key=lambda h: self.b.fingerprints[h])
        if order == slots:
            return s
        new_index = {old: slots[i] for i, old in enumerate(order)}
        holders = [s.holders[0]] * len(s.holders)
        for old, new in new_index.items():
            holders[new] = s.holders[old]
        rec = s.rec
        if rec is not None:
            response = new_index[rec.response] if rec.response >= 0 else rec.response
            rec = rec._replace(owner=new_index[rec.owner], response=response)
        return s._replace(rec=rec, holders=tuple(holders))

    def initial(self) -> State:
        return State(0, None, 0, 0, None, tuple(_idle() for _ in range(self.b.holders)))

    def purgeable(self, rec: Rec, before: int) -> bool:
        return rec.expires <= before and (rec.state != IN_PROGRESS or rec.lease_end <= before)

    def moves(self, s: State) -> Iterator[Action]:
        """Every action enabled in ``s``."""
        rec = s.rec
        if s.now < self.b.max_time:
            yield _TICK
        for h, holder in enumerate(s.holders):
            if holder.holding:
                yield Action("settle", h, COMPLETED)
                yield Action("settle", h, FAILED)
                yield Action("release", h)
                yield Action("renew", h)
            else:
                yield Action("reserve", h)
                if holder.settled:
                    yield Action("settle-again", h, holder.settled)
        if rec is not None:
            if s.pending is None and self.purgeable(rec, s.now):
                yield _PURGE_PICK
            if rec.expires <= s.now:
                yield _EXPIRE
            yield _EVICT
        if s.pending is not None:
            yield _PURGE_DELETE

    def take(self, s: State, action: Action) -> State:
        """The state after ``action``; raises `_Violated` if the step breaks an invariant."""
        kind, h = action.kind, action.holder
        if kind == "tick":
            return s._replace(now=s.now + 1)
        if kind == "reserve":
            return self._reserve(s, h)
        if kind in ("settle", "settle-again"):
            return self._settle(s, h, action.status)
        if kind == "release":
            return self._release(s, h)
        if kind == "renew":
            return self._renew(s, h)
        if kind == "purge-pick":
            return s._replace(pending=s.now)
        if kind == "purge-delete":
            return self._purge_delete(s)
        if kind == "expire":
            return self._delete(s, "expire")
        assert kind == "evict", kind
        return self._evict(s)

    # -- the store's steps ---------------------------------------------------------------
    def _reserve(self, s: State, h: int) -> State:
        rec, now = s.rec, s.now
        if rec is not None and rec.expires > now:
            if self.b.fingerprints[rec.owner] != self.b.fingerprints[h]:
                return s  # mismatch: nothing changes
            if rec.state != IN_PROGRESS or rec.lease_end > now:
                return s  # replay, or in progress
        token = s.counter + 1  # the store-wide counter, which never goes back
        if self.v.tokens_restart:
            token = 1 if rec is None else rec.token + 1
        if token > self.b.max_token:
            return s  # beyond the bounds explored: this run stops handing out tokens
        if self.v.check_tokens:
            _check(token > s.highest, "token-grows", f"token {token} after {s.highest}")
        if rec is not None and rec.state != IN_PROGRESS:
            _check(rec.expires <= now, "retention-kept", f"{rec} replaced at {now}")
        for g, other in enumerate(s.holders):
            _check(
                g == h or not other.holding or other.evicted or other.lease_end <= now,
                "single-live-holder",
                f"holder {h} acquired at {now} while holder {g}'s lease runs to {other.lease_end}",
            )
        holders = list(s.holders)
        holders[h] = Holder(token, True, now + self.b.lease, "", False)
        return State(
            now,
            Rec(
                IN_PROGRESS, token, now + self.b.lease, now + self.b.lease + self.b.retention, h, -1
            ),
            max(s.counter, token),
            max(s.highest, token),
            s.pending,
            tuple(holders),
        )

    def _lives(self, s: State, h: int) -> bool:
        holder = s.holders[h]
        return holder.holding and not holder.evicted and holder.lease_end > s.now

    def _settle(self, s: State, h: int, status: str) -> State:
        rec, holder = s.rec, s.holders[h]
        first = holder.holding
        accepted = rec is not None and rec.token == holder.token
        if accepted and rec is not None and rec.state != IN_PROGRESS:
            accepted = rec.state == status and rec.response == h  # the same settle again
        holders = list(s.holders)
        if not accepted:
            if first:
                _check(not self._lives(s, h), "holder-not-lost", f"holder {h}'s settle refused")
            holders[h] = _stop(holder)
            return s._replace(holders=tuple(holders))
        assert rec is not None
        _check(rec.owner == h, "fenced-settle", f"holder {h} settled holder {rec.owner}'s {rec}")
        holders[h] = Holder(holder.token, False, 0, status, False)
        if rec.state == IN_PROGRESS:
            rec = Rec(status, rec.token, 0, max(rec.expires, s.now + self.b.retention), h, h)
        return s._replace(rec=rec, holders=tuple(holders))

    def _release(self, s: State, h: int) -> State:
        rec, holder = s.rec, s.holders[h]
        holders = list(s.holders)
        holders[h] = _stop(holder)
        s = s._replace(holders=tuple(holders))
        if rec is None or rec.state != IN_PROGRESS:
            return s
        if rec.token != holder.token and not self.v.release_unfenced:
            return s
        _check(rec.owner == h, "fenced-release", f"holder {h} released holder {rec.owner}'s")
        return s._replace(rec=None)

    def _renew(self, s: State, h: int) -> State:
        rec, holder = s.rec, s.holders[h]
        holders = list(s.holders)
        if rec is None or rec.token != holder.token or rec.state != IN_PROGRESS:
            _check(not self._lives(s, h), "holder-not-lost", f"holder {h}'s renewal refused")
            holders[h] = _stop(holder)
            return s._replace(holders=tuple(holders))
        until = s.now + self.b.lease
        expires = rec.expires if self.v.renew_keeps_retention else max(rec.expires, until)
        holders[h] = holder._replace(lease_end=until)
        return s._replace(
            rec=rec._replace(lease_end=until, expires=expires), holders=tuple(holders)
        )

    def _purge_delete(self, s: State) -> State:
        before = s.pending
        assert before is not None
        s = s._replace(pending=None)
        rec = s.rec
        if rec is None:
            return s
        if not self.v.purge_by_key and not self.purgeable(rec, before):
            return s  # the record is not what was picked any more: leave it
        return self._delete(s, "purge")

    def _delete(self, s: State, by: str) -> State:
        rec = s.rec
        assert rec is not None
        _check(self.purgeable(rec, s.now), "purge-safe", f"{by} deleted {rec} at {s.now}")
        return s._replace(rec=None)

    def _evict(self, s: State) -> State:
        rec = s.rec
        assert rec is not None
        holders = list(s.holders)
        owner = holders[rec.owner]
        if owner.holding and owner.token == rec.token:
            holders[rec.owner] = owner._replace(evicted=True)
        return s._replace(rec=None, holders=tuple(holders))


def explore(bounds: Bounds, variant: Variant | None = None) -> Result:
    """Visit every reachable state; stop at the first violation (with a shortest trace)."""
    protocol = Protocol(bounds, variant or Variant())
    started = time.perf_counter()
    start = protocol.initial()
    # Keyed by canonical state; the queue holds the states as the actions made them, so a
    # trace reads as the holders really acted.
    parents: dict[State, tuple[State, Action] | None] = {start: None}
    queue = deque([(start, 0)])
    result = Result()
    actions: dict[str, int] = {}
    while queue and result.violation is None:
        state, depth = queue.popleft()
        result.depth = max(result.depth, depth)
        for action in protocol.moves(state):
            result.transitions += 1
            actions[action.kind] = actions.get(action.kind, 0) + 1
            try:
                nxt = protocol.take(state, action)
            except _Violated as broken:
                trace = [*_trace(parents, protocol, state), f"{action}  <- {broken.detail}"]
                result.violation = Violation(broken.invariant, broken.detail, trace)
                break
            key = protocol.canonical(nxt)
            if key not in parents:
                parents[key] = (state, action)
                queue.append((nxt, depth + 1))
    result.states = len(parents)
    result.seen = set(parents)
    result.actions = actions
    result.seconds = time.perf_counter() - started
    return result


def _trace(
    parents: dict[State, tuple[State, Action] | None], protocol: Protocol, state: State
) -> list[str]:
    steps: list[str] = []
    link = parents[protocol.canonical(state)]
    while link is not None:
        previous, action = link
        steps.append(str(action))
        link = parents[protocol.canonical(previous)]
    return list(reversed(steps))


def describe(result: Result) -> str:
    """The counts, the time and any violation with its trace, for a test's message."""
    text = f"{result.states} states, {result.transitions} transitions, depth {result.depth}"
    text += f", {result.seconds:.2f} s"
    if result.violation is not None:
        v = result.violation
        text += f"\n{v.invariant}: {v.detail}\n  " + "\n  ".join(v.trace)
    return text
