"""The Redis store's halves, without a server: its Lua scripts ship as package data, and its
verbs are generators that name each Redis call (the hot ones: one call, one round trip).

The behaviour on a real server is in the other tests/test_redis*.py files.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from importlib.resources import files
from typing import Any

import pytest

from idempo import FencedError, Scope, Status
from idempo._core.record import Acquired, Replay
from idempo.stores.redis import _ops
from idempo.stores.redis._ops import Batch, Command, Primaries, Run
from idempo.stores.redis._protocol import Keys
from idempo.stores.redis._scripts import SCRIPTS

LEASE = timedelta(seconds=30)
TTL = timedelta(hours=1)
SCOPE = Scope("alice", "POST /payments", "k1")
KEYS = Keys("test", timedelta(minutes=1))
NOW = datetime(2026, 1, 2, 3, 4, 5, 6, tzinfo=UTC)


def test_every_script_ships_as_a_package_data_file() -> None:
    """Each script is a .lua file inside the package (hatchling's wheel takes every file under
    src/idempo), found by importlib.resources as an installed copy would be."""
    lua = files("idempo.stores.redis").joinpath("lua")
    names = sorted(item.name for item in lua.iterdir() if item.name.endswith(".lua"))
    assert names == [
        "common.lua",
        "purge.lua",
        "release.lua",
        "renew.lua",
        "reserve.lua",
        "settle.lua",
    ]
    helpers = lua.joinpath("common.lua").read_text(encoding="utf-8")
    for name, text in SCRIPTS.items():
        own = lua.joinpath(f"{name}.lua").read_text(encoding="utf-8")
        assert text in (own, helpers + own)
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


def test_a_reserve_is_one_script_call_and_a_lost_one_is_undone_by_its_nonce() -> None:
    calls, reservation = steps(_ops.reserve(KEYS, SCOPE, "fp", NOW, LEASE, TTL), 1234)

    (run,) = calls
    assert isinstance(run, Run)
    assert (run.script, run.key, run.scope) == ("reserve", KEYS.key(SCOPE), SCOPE)
    assert reservation == Acquired(token=1234)
    undo = _ops.undo(run)
    assert undo is not None
    assert (undo.script, undo.key, undo.args) == ("release", run.key, ["n", run.args[-1]])


def test_a_replay_is_decoded_from_the_reserve_reply() -> None:
    stamp = b"1767323045000006"
    reply = [3, b"completed", b"7", b"{}", stamp, stamp, b"1767326645000006", None]
    _, reservation = steps(_ops.reserve(KEYS, SCOPE, "fp", None, LEASE, TTL), reply)

    assert isinstance(reservation, Replay)
    assert reservation.record.token == 7
    assert reservation.record.response == b"{}"


@pytest.mark.parametrize(
    "flow",
    [
        pytest.param(
            lambda: _ops.settle(KEYS, SCOPE, 7, Status.COMPLETED, b"{}", NOW, TTL), id="settle"
        ),
        pytest.param(lambda: _ops.renew(KEYS, SCOPE, 7, NOW, LEASE), id="renew"),
    ],
)
def test_settles_and_renewals_are_one_fenced_script_call(flow: Any) -> None:
    calls, _ = steps(flow(), 1)
    (run,) = calls
    assert isinstance(run, Run)
    assert run.args[0] == "7"
    assert _ops.undo(run) is None  # fenced and repeatable: nothing to undo
    with pytest.raises(FencedError):
        steps(flow(), 0)


def test_release_is_one_script_call_by_token() -> None:
    calls, _ = steps(_ops.release(KEYS, SCOPE, 7), 1)
    assert [(c.script, c.args) for c in calls] == [("release", ["tok", "7"])]


def test_purge_pipelines_its_scripts_on_a_server_and_runs_them_one_by_one_on_a_cluster() -> None:
    server, purged = steps(_ops.purge(KEYS, None, 10, cluster=False), [0, [b"a", b"b"]], [1, 1])
    assert isinstance(server[0], Command)
    assert isinstance(server[1], Batch)
    assert [run.key for run in server[1].calls] == [b"a", b"b"]
    assert purged == 2

    cluster, purged = steps(
        _ops.purge(KEYS, None, 10, cluster=True), ["node"], [{"node": 0}, [b"a", b"b"]], 1, 0
    )
    assert isinstance(cluster[0], Primaries)
    assert cluster[1].options["target_nodes"] == "node"
    assert [type(call) for call in cluster[2:]] == [Run, Run]
    assert purged == 1


def test_purge_stops_at_its_limit() -> None:
    calls, purged = steps(_ops.purge(KEYS, None, 1, cluster=False), [5, [b"a", b"b"]], [1])
    assert purged == 1
    assert [run.key for run in calls[1].calls] == [b"a"]


def test_stats_counts_states_and_skips_what_is_not_a_record() -> None:
    _, counts = steps(
        _ops.stats(KEYS, cluster=False),
        [0, [b"a", b"b", b"c"]],
        [b"completed", b"in_progress", Exception("WRONGTYPE")],
    )
    assert counts == {"completed": 1, "in_progress": 1}
