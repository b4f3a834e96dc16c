"""The Lua scripts, one file each in ``lua/`` (package data), read once at import.

Scripts run only where a plain command cannot do the work atomically: the reserve script
(the second step of a reservation whose ``SET NX`` found a record in progress, a tombstone or
a record on another clock: take it over or hand it back), the fenced settle, renewal and
checkpoint, release (and the undo of a reservation by its nonce), evict, purge, the
conversion of a record of the previous layout, and the mark of a duplicate that waits for a
fresh reservation to settle (so that its settle publishes). Each starts with common.lua (the
record's layout, the clock, a key's PX) and all but settle with record.lua (parsing a
record's header, a derived record's times, tombstones, the previous layout).

Inside them every redis.call, string.sub and struct call costs the server some instructions,
so the hot one (settle) reads the record once, reads its header as numbers, rewrites the
value with the strings copied as one piece, and publishes only where a waiter may listen.

Lua numbers are doubles: microsecond timestamps and tokens (~1.8e15) are exact. A number a
script answers is sent by Redis as an integer reply.

    >>> sorted(SCRIPTS)
    ['evict', 'mark', 'purge', 'release', 'renew', 'reserve', 'settle', 'upgrade']
"""

from __future__ import annotations

from importlib.resources import files

RESERVE, SETTLE, RENEW, RELEASE, EVICT, PURGE, UPGRADE, MARK = (
    "reserve",
    "settle",
    "renew",
    "release",
    "evict",
    "purge",
    "upgrade",
    "mark",
)

_PACKAGE = __name__.rpartition(".")[0]


def _read(name: str) -> str:
    return files(_PACKAGE).joinpath("lua", f"{name}.lua").read_text(encoding="utf-8")


# What each script starts with: common.lua (the layout, the clock, a key's PX) for every one;
# record.lua (parsing a record, a derived record's times, tombstones, the previous layout)
# for all but the hottest, settle, which reads its header itself: every function a script
# defines costs each call some instructions.
_HELPERS = {SETTLE: ("common",)}


def _script(name: str) -> str:
    return "".join(_read(helper) for helper in _HELPERS.get(name, ("common", "record"))) + _read(
        name
    )


SCRIPTS: dict[str, str] = {
    name: _script(name) for name in (RESERVE, SETTLE, RENEW, RELEASE, EVICT, PURGE, UPGRADE, MARK)
}
