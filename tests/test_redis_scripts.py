"""The Redis store's halves, without a server: its Lua scripts ship as package data, its
records are one string each, and its verbs are generators that name each Redis call (a fresh
reservation and a replay: one plain ``SET NX GET``; a settle, a release, a renewal: one
script).

The behaviour on a real server is in the other tests/test_redis*.py files.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from importlib.resources import files
from typing import Any

import pytest

from idempo import CorruptRecordError, FencedError, Scope, Status
from idempo._core.record import Acquired, InProgress, Mismatch, Replay
from idempo.stores.redis import _ops, _protocol
from idempo.stores.redis._ops import Batch, Command, Place, Primaries, Run
from idempo.stores.redis._protocol import HEADER, Keys
from idempo.stores.redis._scripts import SCRIPTS

LEASE = timedelta(seconds=30)
TTL = timedelta(hours=1)
SCOPE = Scope("alice", "POST /payments", "k1")
KEYS = Keys("test", timedelta(minutes=1))
NOW = datetime(2026, 1, 2, 3, 4, 5, 6, tzinfo=UTC)
FP = "ab" * 32
TIME = [b"1767323045", b"6"]  # NOW, as Redis's TIME answers it
LATER = 1_767_400_000_000_000  # µs, after NOW


def test_every_script_ships_as_a_package_data_file() -> None:
    """Each script is a .lua file inside the package (hatchling's wheel takes every file under
    src/idempo), found by importlib.resources as an installed copy would be, after the
    helpers every script starts with."""
    lua = files("idempo.stores.redis").joinpath("lua")
    names = sorted(item.name for item in lua.iterdir() if item.name.endswith(".lua"))
    assert names == [
        "common.lua",
        "evict.lua",
        "mark.lua",
        "purge.lua",
        "record.lua",
        "release.lua",
        "renew.lua",
        "reserve.lua",
        "settle.lua",
        "upgrade.lua",
    ]
    common, record = (
        lua.joinpath(f"{n}.lua").read_text(encoding="utf-8") for n in ("common", "record")
    )
    for name, text in SCRIPTS.items():
        helpers = common if name == "settle" else common + record  # settle reads its own header
        assert text == helpers + lua.joinpath(f"{name}.lua").read_text(encoding="utf-8")
        assert "redis.call" in text


def steps(flow: Any, *replies: Any) -> tuple[list[Any], Any]:
    """Drive ``flow`` with ``replies``: the calls it yielded and its result."""
    calls = [next(flow)]
    for reply in replies:
        try:
            calls.append(flow.send(reply))
        except StopIteration as stop:
            return calls, stop.value
    pytest.fail(f"the flow wanted more than {len(replies)} replies: {calls}")  # pragma: no cover


def fresh_keys() -> Keys:
    """Keys whose clock has been read once (so a reserve starts with its SET)."""
    keys = Keys("test", timedelta(minutes=1))
    now = keys.clock.ticks()
    keys.clock.anchor(TIME, now, now)
    return keys


def test_a_fresh_reserve_is_one_plain_set_and_a_lost_one_is_undone_by_its_nonce() -> None:
    """The first reserve of a store reads Redis's clock once (for its tokens); then a fresh
    key is one SET NX GET of the whole record, and the undo of a reply never heard releases
    by the nonce written in it."""
    keys = Keys("test", timedelta(minutes=1))
    calls, reservation = steps(_ops.reserve(keys, SCOPE, FP, None, LEASE, TTL), TIME, None)

    clock, command = calls
    assert (clock.name, clock.args) == ("time", ())
    assert isinstance(command, Command)
    assert command.name == "execute_command"
    name, key, value, *options = command.args
    assert (name, key) == ("SET", KEYS.key(SCOPE))
    assert options == ["NX", "GET", "PX", 3_630_000]
    assert command.options == {"get": True}  # redis-py's SET callback answers the value
    assert isinstance(reservation, Acquired)
    stored = _protocol.decode(value, SCOPE, expiry_ms=1_767_326_675_000)
    assert stored.record is not None
    assert (stored.token, stored.record.fingerprint) == (reservation.token, FP)
    assert stored.record.created_at == datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    assert stored.record.lease_expires_at == stored.record.created_at + LEASE
    assert len(value) == HEADER.size + 32 + len("alicePOST /paymentsk1")  # the hex packed
    undo = _ops.undo(command)
    assert undo is not None
    assert (undo.script, undo.keys, undo.args) == ("release", [key], ["n", value[42:50]])


def test_tokens_of_fresh_reservations_estimate_redis_clock_and_only_grow() -> None:
    keys = fresh_keys()
    first = keys.clock.token()
    assert first >= 1_767_323_045_000_006
    later = [keys.clock.token() for _ in range(3)]
    assert first < later[0] < later[1] < later[2]
    assert not keys.clock.stale()


def settled(status: bytes = b"c", clock: bytes = b"r", fp: str = FP) -> bytes:
    at = _protocol.us(NOW)
    stored, code = _protocol.stored_fingerprint(fp)
    header = HEADER.pack(status, clock, 7, at, at, 0, at + 3_600_000_000, b"\0" * 8, code, 0,
                         5, 14, 2)  # fmt: skip
    return header + stored + b"alicePOST /paymentsk1" + b"{}"


@pytest.mark.parametrize(
    ("value", "now", "expected"),
    [
        pytest.param(settled(), None, Replay, id="settled-on-redis-clock-replays"),
        pytest.param(settled(fp="other"), None, Mismatch, id="another-fingerprint"),
        pytest.param(settled(clock=b"g"), NOW, Replay, id="given-clock-judged-at-now"),
        pytest.param(settled(clock=b"g"), None, None, id="given-clock-on-redis-clock"),
        pytest.param(settled(clock=b"g"), NOW + 2 * TTL, None, id="past-retention"),
        pytest.param(settled(b"x"), None, None, id="tombstone"),
    ],
)
def test_what_a_set_found_is_judged_without_a_script_when_it_can_be(
    value: bytes, now: datetime | None, expected: type | None
) -> None:
    """A settled record on Redis's clock replays from the SET's answer alone (a key Redis
    holds is inside its retention); what needs Redis's clock, or a takeover, goes to the
    reserve script."""
    keys = fresh_keys()
    flow = _ops.reserve(keys, SCOPE, FP, now, LEASE, TTL)
    set_call = next(flow)
    if expected is None:
        script = flow.send(value)
        assert isinstance(script, Run)
        assert script.script == "reserve"
        return
    with pytest.raises(StopIteration) as done:
        flow.send(value)
    assert isinstance(done.value.value, expected)
    assert set_call.args[0] == "SET"


def test_a_replay_is_decoded_from_the_record_byte_for_byte() -> None:
    _, reservation = steps(_ops.reserve(fresh_keys(), SCOPE, FP, None, LEASE, TTL), settled())
    assert isinstance(reservation, Replay)
    assert (reservation.record.token, reservation.record.response) == (7, b"{}")
    assert reservation.record.expires_at == NOW + TTL


def test_a_reserve_script_answer_is_judged_at_its_now() -> None:
    """The reserve script hands back a record with the instant it judged at: in progress
    there means "come back when its lease ends"."""
    keys = fresh_keys()
    at = _protocol.us(NOW)
    stored, code = _protocol.stored_fingerprint(FP)
    live = HEADER.pack(b"i", b"r", 9, at, at, at + 10_000_000, at + 3_600_000_000, b"n" * 8, code,
                       0, 5, 14, 2) + stored + b"alicePOST /paymentsk1"  # fmt: skip
    _, reservation = steps(
        _ops.reserve(keys, SCOPE, FP, None, LEASE, TTL), live, [0, at + 4_000_000, live, 0]
    )
    assert reservation == InProgress(retry_after=6.0)
    _, taken = steps(_ops.reserve(keys, SCOPE, FP, None, LEASE, TTL), live, [1, 10, None, 1])
    assert taken == Acquired(token=10, taken_over=True)
    with pytest.raises(CorruptRecordError, match="evict"):
        steps(_ops.reserve(keys, SCOPE, FP, None, LEASE, TTL), b"garbage")


def test_a_record_on_a_given_clock_is_listed_for_purge() -> None:
    calls, reservation = steps(_ops.reserve(fresh_keys(), SCOPE, FP, NOW, LEASE, TTL), None, [])
    assert isinstance(reservation, Acquired)
    listing = calls[1]
    assert isinstance(listing, Batch)
    assert [c.name for c in listing.calls] == ["zadd", "pexpire", "pexpire"]
    assert listing.calls[0].args == (
        "test:expiring",
        {KEYS.digest(SCOPE): _protocol.us(NOW + LEASE + TTL)},
    )


@pytest.mark.parametrize(
    "flow",
    [
        pytest.param(
            lambda: _ops.settle(KEYS, SCOPE, 7, Status.COMPLETED, b"{}", None, TTL), id="settle"
        ),
        pytest.param(lambda: _ops.renew(KEYS, SCOPE, 7, None, LEASE), id="renew"),
    ],
)
def test_settles_and_renewals_are_one_fenced_script_call(flow: Any) -> None:
    calls, _ = steps(flow(), 1_767_326_645_000_006)
    (run,) = calls
    assert isinstance(run, Run)
    assert run.args[0] in (7, (7).to_bytes(8, "big"))  # settle compares it as a number
    assert _ops.undo(run) is None  # fenced and repeatable: nothing to undo
    with pytest.raises(FencedError):
        steps(flow(), 0)


def test_a_settle_on_redis_clock_carries_an_estimate_that_never_runs_ahead() -> None:
    """On Redis's clock a settle sends this process's estimate of that clock, with the TIME
    reading placed at the end of its round trip (so no later than Redis's), or '' when the
    estimate is stale (the script reads TIME); on a given clock, that clock and no estimate."""
    keys = Keys("test", timedelta(minutes=1))
    assert keys.settle_args(7, Status.COMPLETED, b"{}", None, TTL)[3:] == [
        "",
        3_600_000_000,
        60_000,
        "",
    ]
    sent = keys.clock.ticks()
    keys.clock.anchor(TIME, sent, sent + 4_000_000)  # a 4 ms round trip
    before = keys.clock.early()
    args = keys.settle_args(7, Status.COMPLETED, b"{}", None, TTL)
    after = keys.clock.early()
    assert before is not None
    assert after is not None
    assert args[3] == ""
    assert isinstance(args[6], int)
    assert before <= args[6] <= after
    # The reading placed at the end of the round trip: 2 ms behind its middle, which tokens use.
    assert keys.clock._offset - keys.clock._early == 2_000_000  # ns
    assert keys.settle_args(7, Status.FAILED, b"{}", NOW, TTL)[3::3] == [
        str(_protocol.us(NOW)),
        "",
    ]


def test_release_is_one_script_call_by_token() -> None:
    calls, _ = steps(_ops.release(KEYS, SCOPE, 7), 1)
    assert [(c.script, c.args) for c in calls] == [("release", ["t", (7).to_bytes(8, "big")])]


def test_purge_reads_the_listed_records_and_never_scans_for_a_cutoff_behind_redis() -> None:
    """purge asks Redis's clock, reads the records listed as due by then, runs its script on
    them (one call for a page on a server, one per key on a cluster), and drops the deleted
    ones from the list; with nothing due, it is done: no SCAN."""
    digests = [b"a" * 64, b"b" * 64]
    calls, purged = steps(
        _ops.purge(KEYS, Place(), None, 10, cluster=False), TIME, digests, [-1, LATER], [1, 1], []
    )
    assert [type(c) for c in calls] == [Command, Command, Run, Batch, Command]
    assert calls[2].keys == [KEYS.record_key(d) for d in digests]
    assert [c.name for c in calls[3].calls] == ["zrem", "zadd"]
    assert calls[3].calls[0].args == ("test:expiring", digests[0])
    assert purged == 1

    calls, purged = steps(
        _ops.purge(KEYS, Place(), None, 10, cluster=True), TIME, digests, [-1], [-2], [1], []
    )
    assert [type(c) for c in calls] == [Command, Command, Run, Run, Batch, Command]
    assert calls[4].calls[0].args == ("test:expiring", *digests)
    assert purged == 1


def test_a_purge_ahead_of_redis_clock_sweeps_and_keeps_its_place() -> None:
    """A cutoff later than Redis's clock may cover records on Redis's clock too: a SCAN that
    goes on, in the next purge, from where the last one stopped."""
    place = Place()
    later = datetime(2026, 1, 3, tzinfo=UTC)
    calls, purged = steps(
        _ops.purge(KEYS, place, later, 2, cluster=False), TIME, [], [7, [b"k1", b"k2", b"k3"]],
        [-1, -1],
    )  # fmt: skip
    assert purged == 2
    assert calls[2].name == "scan"
    assert calls[2].args == (0,)
    assert (place.cursor, place.left) == (7, [b"k3"])

    calls, purged = steps(
        _ops.purge(KEYS, place, later, 5, cluster=False), TIME, [], [-1], [0, [b"k4"]], [-1]
    )
    assert calls[2].keys == [b"k3"]
    assert calls[3].args == (7,)
    assert purged == 2
    assert (place.node, place.cursor, place.left) == (0, 0, [])  # the sweep is over


def test_a_cluster_sweep_goes_node_by_node() -> None:
    calls, purged = steps(
        _ops.purge(KEYS, Place(), datetime(2026, 1, 3, tzinfo=UTC), 5, cluster=True),
        TIME, [], ["n1", "n2"], [{"n1": 0}, [b"a"]], [-1], [{"n2": 0}, []],
    )  # fmt: skip
    assert isinstance(calls[2], Primaries)
    assert [c.options.get("target_nodes") for c in calls if isinstance(c, Command)][-2:] == [
        "n1",
        "n2",
    ]
    assert purged == 1


def test_stats_counts_states_and_skips_tombstones_and_what_is_not_a_record() -> None:
    _, counts = steps(
        _ops.stats(KEYS, cluster=False),
        [0, [b"a", b"b", b"c", b"d", b"e"]],
        [b"c", b"i", b"x", b"z", Exception("WRONGTYPE")],
    )
    assert counts == {"completed": 1, "in_progress": 1}


@pytest.mark.parametrize(
    "micros", [0, 1, -1, 999_999, 1_767_323_045_123_456, 2**53 - 1, -(2**40) - 7]
)
def test_record_times_decode_exactly(micros: int) -> None:
    """A stored time comes back to the microsecond (decoded by multiplying a timedelta, not
    by building one from keyword arguments)."""
    epoch = datetime(1970, 1, 1, tzinfo=UTC)
    assert _protocol._time(micros) == epoch + timedelta(microseconds=micros)
    assert _protocol.us(_protocol._time(micros)) == micros


def test_names_are_cached_by_the_scopes_strings() -> None:
    """Equal scopes name one key, distinct ones distinct keys, and a reservation's value
    carries its own scope's strings: the cache is keyed by the strings themselves."""
    keys = fresh_keys()
    one, same = Scope("a", "op", "k"), Scope("a", "op", "k")
    others = [Scope("", "aop", "k"), Scope("a", "o", "pk"), Scope("a", "op", "K")]
    assert keys.key(one) == keys.key(same)
    assert len({keys.key(s) for s in [one, *others]}) == 4
    for scope in [one, *others]:
        names = _protocol.named(keys.prefix, scope)
        value, _ = keys.fresh(names, FP, 1, b"\0" * 8, None, LEASE, timedelta(hours=1))
        assert _protocol.decode(value, None, 10**12).record.scope == scope  # type: ignore[union-attr]
    assert _protocol.named("other", one)[0] != keys.key(one)
