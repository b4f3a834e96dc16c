"""The Lua scripts, one file each in ``lua/`` (package data), read once at import.

Every record transition is one script, so it is atomic on Redis's one thread. Inside them
every redis.call, field read or written, element answered, string.format and tonumber costs
the server a few thousand instructions, so the hot paths (reserve of a fresh key, reserve of a
replay, settle) each do only what they need: a fresh key costs an EXISTS, not a read of every
field; a replay reads the fields a replay answers and no lease; a settled record keeps its
last 'le' and 'n' (deleting them would be one more call, and a lease means nothing once
settled).

Lua numbers are doubles: microsecond timestamps and tokens (~1.8e15) are exact. tostring()
would print them in exponent form, so a number a script stores goes out through
string.format('%d'), and one it answers as a Lua number, which Redis sends as an integer
reply. A TTL that is a plain sum of durations arrives ready-made, in milliseconds.

    >>> sorted(SCRIPTS)
    ['purge', 'release', 'renew', 'reserve', 'settle']
"""

from __future__ import annotations

from importlib.resources import files

RESERVE, SETTLE, RENEW, RELEASE, PURGE = "reserve", "settle", "renew", "release", "purge"

# The scripts that start with common.lua's helpers.
_WITH_HELPERS = frozenset({RENEW, PURGE})


_PACKAGE = __name__.rpartition(".")[0]


def _read(name: str) -> str:
    return files(_PACKAGE).joinpath("lua", f"{name}.lua").read_text(encoding="utf-8")


def _script(name: str) -> str:
    return (_read("common") if name in _WITH_HELPERS else "") + _read(name)


SCRIPTS: dict[str, str] = {name: _script(name) for name in (RESERVE, SETTLE, RENEW, RELEASE, PURGE)}
