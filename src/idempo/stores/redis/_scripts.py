"""The Lua scripts, one file each in ``lua/`` (package data), read once at import.

Scripts run only where a plain command cannot do the work atomically: the reserve script
(the second step of a reservation whose ``SET NX`` found a record in progress, a tombstone or
a record on another clock: take it over or hand it back), the fenced settle, renewal and
checkpoint, release (and the undo of a reservation by its nonce), evict, purge and the
conversion of a record of the previous layout. Each starts with common.lua (the record's
layout, the clock, a key's PX) and all but settle with record.lua (parsing a record's header,
a derived record's times, tombstones, the previous layout).

Inside them every redis.call, string.sub and struct call costs the server some instructions,
so the hot ones (settle) read the record once, compare the token as the 8 bytes it is stored
as, and rewrite the value with the strings copied as one piece.

Lua numbers are doubles: microsecond timestamps and tokens (~1.8e15) are exact. A number a
script answers is sent by Redis as an integer reply.

    >>> sorted(SCRIPTS)
    ['evict', 'purge', 'release', 'renew', 'reserve', 'settle', 'upgrade']
"""

from __future__ import annotations

from importlib.resources import files

RESERVE, SETTLE, RENEW, RELEASE, EVICT, PURGE, UPGRADE = (
    "reserve",
    "settle",
    "renew",
    "release",
    "evict",
    "purge",
    "upgrade",
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
    name: _script(name) for name in (RESERVE, SETTLE, RENEW, RELEASE, EVICT, PURGE, UPGRADE)
}
