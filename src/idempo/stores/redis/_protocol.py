"""Redis's side of the record protocol, without I/O: key names, the record's bytes, the
arguments of the commands and scripts, their replies.

Every function here is pure, but for `TokenClock`'s estimate of Redis's clock: the operations
in `_ops` build their calls with it and decode what the faces bring back.

**The record** is one string (lua/common.lua lists the layout): a 59-byte header (state,
clock, token, four times, the reservation's nonce, five lengths), then the fingerprint (64
hex digits stored as their 32 bytes), the recovery point, the principal, the operation, the
key and, once settled, the response. Times are integer microseconds since the epoch (Lua
numbers are doubles: exact below 2^53, until the year 2255).

**Whose clock.** A record on Redis's clock (``now=None``) has its key expire exactly when its
retention ends, so a key Redis still holds is inside its retention on Redis's clock. The
fresh reservation is a plain ``SET NX``, which cannot read Redis's clock: it stores the lease
and the key's PX as durations (clock ``d``), and its times are the key's own expiry
(``PEXPIRETIME``, set by Redis from its clock as it created the key) minus those. Every
script that rewrites a record reads ``TIME`` and stores absolute times (clock ``r``). A
record on a clock the caller gave (clock ``g``) stores that clock's times; its key expires
that long after the caller's ``now`` plus the grace, and it is listed in the store's sorted
set ``<prefix>:expiring`` by when it may be purged.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import struct
import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any

from ..._core.digest import key_ref
from ..._core.keys import Scope, evict_hint
from ..._core.record import (
    Acquired,
    Mismatch,
    Record,
    Replay,
    Reservation,
    Status,
    judge,
)
from ...errors import ConfigurationError, CorruptRecordError, FencedError, StoreError

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_US = timedelta(microseconds=1)
_MS = timedelta(milliseconds=1)

HEADER = struct.Struct(">ccqqqqq8sHHHHB")
HEADER_SIZE = HEADER.size  # 59
_TOKEN = struct.Struct(">q")
_PACKED_FP = 0x8000  # the fingerprint's length code for 64 hex digits stored as 32 bytes
_MAX_STRING = 0xFFFF

IN_PROGRESS, COMPLETED, FAILED, TOMBSTONE = b"i", b"c", b"f", b"x"
REDIS_CLOCK, GIVEN_CLOCK, DERIVED_CLOCK = b"r", b"g", b"d"
_STATUSES = {IN_PROGRESS: Status.IN_PROGRESS, COMPLETED: Status.COMPLETED, FAILED: Status.FAILED}
_STATES = {Status.COMPLETED: "c", Status.FAILED: "f"}
_CLOCKS = frozenset({REDIS_CLOCK, GIVEN_CLOCK, DERIVED_CLOCK})

# How much of each value a listing reads: the header and the strings before the response.
LISTED_BYTES = 4096


def micros(moment: datetime | None) -> str:
    """A script's ``now``: the caller's clock in µs, or '' for Redis's."""
    return "" if moment is None else str((moment - _EPOCH) // _US)


def us(moment: datetime) -> int:
    """A time as records store it: µs since the epoch."""
    return (moment - _EPOCH) // _US


def _span(delta: timedelta) -> int:
    return delta // _US


def _time(value: int) -> datetime:
    # A timedelta times an int is exact, and skips the keyword parsing of
    # timedelta(microseconds=...), which cost a replay's decode a third of its time.
    return _EPOCH + _US * value


def corrupt(scope: Scope, why: object) -> CorruptRecordError:
    return CorruptRecordError(
        f"the Redis record of {key_ref(scope.key)} (operation {scope.operation!r})"
        f" cannot be decoded ({why}); nothing was run or replayed."
        f" To evict it, {evict_hint(scope)} (or call store.evict(scope))"
    )


def packed_token(token: int) -> bytes:
    """A token as the record stores it, for a script to compare."""
    try:
        return _TOKEN.pack(token)
    except struct.error:
        return b"\x00" * 8  # no record has it


Named = tuple[str, str, bytes, int, int, int]


def named(prefix: str, scope: Scope) -> Named:
    """The scope's key name, its digest, and its strings as a record stores them (principal,
    operation, key) with their lengths. Cached: a fresh call names its key twice (reserve,
    then settle) and a hot replay names the same key again and again."""
    return _named(prefix, scope.principal, scope.operation, scope.key)


# Keyed by the strings, not the Scope: a str caches its hash, where a Scope's generated
# __hash__ and __eq__ are Python calls on every lookup.
@functools.lru_cache(maxsize=4096)
def _named(prefix: str, principal: str, operation: str, key: str) -> Named:
    triple = json.dumps([principal, operation, key])
    digest = hashlib.sha256(triple.encode()).hexdigest()
    p, o, k = principal.encode(), operation.encode(), key.encode()
    if max(len(p), len(o)) > _MAX_STRING:
        raise ConfigurationError(
            "a Redis store keeps a principal and an operation of at most 65535 bytes each"
        )
    return f"{prefix}:{{{digest}}}", digest, p + o + k, len(p), len(o), len(k)


def stored_fingerprint(fingerprint: str) -> tuple[bytes, int]:
    """The fingerprint as a record stores it, and its length code."""
    if len(fingerprint) == 64:
        try:
            raw = bytes.fromhex(fingerprint)
        except ValueError:
            pass
        else:
            if raw.hex() == fingerprint:
                return raw, _PACKED_FP | 32
    stored = fingerprint.encode()
    if len(stored) >= _PACKED_FP:
        raise ConfigurationError("a Redis store keeps a fingerprint of at most 32767 bytes")
    return stored, len(stored)


class TokenClock:
    """Redis's clock in µs as this process estimates it, for the tokens of fresh reservations.

    A fresh reservation is one plain ``SET NX``: its token is chosen before Redis sees it.
    The estimate is a reading of Redis's ``TIME`` (taken at the middle of its round trip)
    plus the time since on the host's boot clock, which no change of the host's wall clock
    moves; it is read again every `FRESH_FOR` seconds. Tokens this process hands out only grow
    (one past the last when the estimate has not moved), across every store of the process.

    A settle on Redis's clock stamps its time with the `early` estimate, which places the
    reading at the end of its round trip: never later than Redis's clock (but for the drift
    of the host's boot clock over `FRESH_FOR`), which spares the settle script a ``TIME``.
    """

    FRESH_FOR = 30 * 10**9  # ns

    _lock = threading.Lock()
    _last = 0  # the process's last token, shared by every store

    def __init__(self) -> None:
        # Kept as what each call adds to the boot clock (ns), so a call is a clock read, a
        # compare, an add and a division: one per fresh call (a token), one per settle.
        self._until = -1  # the boot clock's ns past which the estimate is stale
        self._offset = 0  # Redis's clock minus the boot clock, at the round trip's middle
        self._early = 0  # the same at its end

    @staticmethod
    def ticks() -> int:
        """The host's boot clock in ns (monotonic, and counting while the host sleeps)."""
        return time.clock_gettime_ns(_BOOT_CLOCK)

    def stale(self) -> bool:
        return self.ticks() > self._until

    def anchor(self, reply: Any, sent: int, received: int) -> None:
        """Learn Redis's clock from a ``TIME`` reply sent at ``sent`` and answered at
        ``received`` (`ticks`); a cluster client answers it per node."""
        if isinstance(reply, dict):
            reply = next(iter(reply.values()))
        seconds, us = reply
        server_ns = (int(seconds) * 1_000_000 + int(us)) * 1000
        middle = (sent + received) // 2
        self._offset = server_ns - middle
        self._early = server_ns - received
        self._until = middle + self.FRESH_FOR

    def early(self) -> int | None:
        """Redis's clock now (µs) with the reading placed at the end of its round trip: no
        later than Redis's; None when the estimate is `stale`."""
        now = time.clock_gettime_ns(_BOOT_CLOCK)  # `ticks`, inlined: once per settle
        if now > self._until:
            return None
        return (now + self._early) // 1000

    def token(self) -> int | None:
        """The next token, or None when the estimate is `stale` (read ``TIME`` first)."""
        now = time.clock_gettime_ns(_BOOT_CLOCK)  # `ticks`, inlined: once per fresh call
        if now > self._until:
            return None
        estimate = (now + self._offset) // 1000
        with TokenClock._lock:
            token = max(estimate, TokenClock._last + 1)
            TokenClock._last = token
        return token

    @classmethod
    def seen(cls, token: int) -> None:
        """A token Redis handed out (a takeover's): later fresh ones grow past it."""
        with cls._lock:
            cls._last = max(cls._last, token)


_BOOT_CLOCK = getattr(time, "CLOCK_BOOTTIME", time.CLOCK_MONOTONIC)


class Keys:
    """A store's key names and the values and arguments of its calls.

    A record lives at ``<prefix>:{<sha256 hex>}``: user strings never appear in key names,
    and the braces are a Redis Cluster hash tag. Records on a given clock are also listed in
    ``<prefix>:expiring``.

    >>> keys = Keys("payments", timedelta(minutes=1))
    >>> keys.key(Scope("alice", "POST /payments", "k1"))
    'payments:{f9031f130b95e02929ecb748d1f13f9e8abc4f4ebf97172e74769aa71f444399}'
    """

    def __init__(self, prefix: str, expiry_grace: timedelta) -> None:
        if not prefix:
            raise ConfigurationError("a Redis store needs a non-empty key prefix")
        self.prefix = prefix
        self.grace_ms = max(1, expiry_grace // _MS)
        escaped = "".join("\\" + c if c in "*?[]\\" else c for c in prefix)
        self.pattern = escaped + ":{*}"
        self.expiring = f"{prefix}:expiring"
        self.clock = TokenClock()

    def key(self, scope: Scope) -> str:
        return named(self.prefix, scope)[0]

    def digest(self, scope: Scope) -> str:
        return named(self.prefix, scope)[1]

    def record_key(self, digest: bytes | str) -> str:
        """The key of the record an ``expiring`` entry names."""
        name = digest.decode() if isinstance(digest, bytes) else digest
        return f"{self.prefix}:{{{name}}}"

    def fresh(
        self,
        names: Named,
        fingerprint: str,
        token: int,
        nonce: bytes,
        now: datetime | None,
        lease: timedelta,
        ttl: timedelta,
    ) -> tuple[bytes, int]:
        """A fresh reservation's value, and its key's PX (ms). ``names``: `named`'s for its
        scope."""
        _, _, strings, p, o, k = names
        fp, code = stored_fingerprint(fingerprint)
        px = math.ceil((lease + ttl) / _MS)
        if now is None:
            header = HEADER.pack(
                IN_PROGRESS, DERIVED_CLOCK, token, 0, 0, _span(lease), px * 1000, nonce,
                code, 0, p, o, k,
            )  # fmt: skip
        else:
            at = us(now)
            header = HEADER.pack(
                IN_PROGRESS, GIVEN_CLOCK, token, at, at, at + _span(lease),
                at + _span(lease + ttl), nonce, code, 0, p, o, k,
            )  # fmt: skip
            px += self.grace_ms
        return header + fp + strings, px

    def reserve_args(
        self,
        scope: Scope,
        fingerprint: str,
        nonce: bytes,
        now: datetime | None,
        lease: timedelta,
        ttl: timedelta,
    ) -> list[str | bytes | int]:
        """The reserve script's arguments (lua/reserve.lua)."""
        fp, code = stored_fingerprint(fingerprint)
        return [
            micros(now),
            _span(lease),
            _span(ttl),
            self.grace_ms,
            nonce,
            fp,
            code,
            scope.principal.encode(),
            scope.operation.encode(),
            scope.key.encode(),
        ]

    def settle_args(
        self, token: int, status: Status, response: bytes, now: datetime | None, ttl: timedelta
    ) -> list[str | bytes | int]:
        """The settle script's arguments (lua/settle.lua). On Redis's clock, its time as this
        process estimates it, no later than Redis's (`TokenClock`): '' when the estimate is
        stale, for the script to read ``TIME``."""
        if now is None:
            early = self.clock.early()
            at, stamp = "", "" if early is None else early
        else:
            at, stamp = micros(now), ""
        return [token, _STATES[status], bytes(response), at, _span(ttl), self.grace_ms, stamp]

    def renew_args(
        self, token: int, now: datetime | None, lease: timedelta
    ) -> list[str | bytes | int]:
        return [packed_token(token), micros(now), _span(lease), self.grace_ms]

    def listing(
        self, digest: str, due: int, px: int
    ) -> list[tuple[str, tuple[Any, ...], dict[str, Any]]]:
        """The commands that list a record on a given clock in ``expiring`` (due: when it may
        be purged, µs), keeping the list at least as long as the record's key (``px``, ms)."""
        return [
            ("zadd", (self.expiring, {digest: due}), {}),
            ("pexpire", (self.expiring, px), {"nx": True}),
            ("pexpire", (self.expiring, px), {"gt": True}),
        ]


def release_args(token: int) -> list[str | bytes | int]:
    return ["t", packed_token(token)]


def undo_args(nonce: bytes) -> list[str | bytes | int]:
    """The release script's arguments that release the reservation made with ``nonce``, if
    it was made and is still in progress."""
    return ["n", nonce]


# -- decoding --------------------------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class Stored:
    """A decoded value: its state and clock bytes, token and nonce, and the record (None for
    a tombstone)."""

    state: bytes
    clock: bytes
    token: int
    nonce: bytes
    record: Record | None


def decode(
    value: bytes, scope: Scope | None, expiry_ms: int | None = None, *, own_scope: bool = False
) -> Stored:
    """The record in ``value``. ``scope``: the caller's, which errors name and the record
    carries, unless ``own_scope`` (or no scope) asks for the one stored in it.
    ``expiry_ms``: the key's PEXPIRETIME, which a record of clock ``d`` derives its times
    from. `CorruptRecordError` (naming ``scope``), or ValueError without one, for bytes that
    are not a record."""
    record = _record(value, scope, expiry_ms, own_scope)
    return Stored(value[:1], value[1:2], _TOKEN.unpack_from(value, 2)[0], value[42:50], record)


def _record(
    value: bytes, scope: Scope | None, expiry_ms: int | None, own_scope: bool
) -> Record | None:
    """`decode`'s record alone (None for a tombstone), which a replay needs: the header's
    fields a caller reads are slices of ``value`` (offsets 0, 1, 2 and 42)."""
    try:
        st, clk, token, ca, ua, le, ea, _nonce, fpn, rpn, pn, on, kn = HEADER.unpack_from(value)
    except struct.error as exc:
        raise _bad(scope, f"{len(value)} bytes, not a record") from exc
    if clk not in _CLOCKS or (st not in _STATUSES and st != TOMBSTONE):
        raise _bad(scope, "an unknown state or clock")
    if clk == DERIVED_CLOCK:
        if expiry_ms is None or expiry_ms < 0:
            raise _bad(scope, "its key has no expiry")
        ea, ca = expiry_ms * 1000, expiry_ms * 1000 - ea
        ua, le = ca, ca + le
    if st == TOMBSTONE:
        return None
    fp_end = HEADER_SIZE + (fpn & 0x7FFF)
    rp_end = fp_end + (rpn - 1 if rpn else 0)
    p_end = rp_end + pn
    o_end = p_end + on
    body = o_end + kn
    if len(value) < body:
        raise _bad(scope, "shorter than its strings")
    raw = value[HEADER_SIZE:fp_end]
    try:
        fingerprint = raw.hex() if fpn & _PACKED_FP else raw.decode()
        point = value[fp_end:rp_end].decode() if rpn else None
        if scope is None or own_scope:
            scope = Scope(value[rp_end:p_end].decode(), value[p_end:o_end].decode(),
                          value[o_end:body].decode())  # fmt: skip
    except UnicodeDecodeError as exc:
        raise _bad(scope, "a string that is not UTF-8") from exc
    settled = st != IN_PROGRESS
    # `_time`, inlined: three calls more on every record read.
    return Record(
        scope,
        fingerprint,
        _STATUSES[st],
        token,
        None if settled else _EPOCH + _US * le,
        value[body:] if settled else None,
        _EPOCH + _US * ca,
        _EPOCH + _US * ua,
        _EPOCH + _US * ea,
        point,
    )


def _bad(scope: Scope | None, why: str) -> Exception:
    return ValueError(why) if scope is None else corrupt(scope, why)


def derived(value: bytes) -> bool:
    """Whether ``value`` is a record whose times derive from its key's expiry."""
    return value[1:2] == DERIVED_CLOCK


def found(
    value: bytes, scope: Scope, fingerprint: str, now: datetime | None, nonce: bytes
) -> Reservation | None:
    """What the record a fresh reservation's ``SET NX GET`` found means, when the caller can
    tell without Redis's clock; None when the reserve script must judge (and maybe take it
    over)."""
    state, clock = value[:1], value[1:2]
    if clock == DERIVED_CLOCK:
        # A fresh reservation on Redis's clock: only its own nonce is judged here (a SET
        # re-sent after a lost reply finds the reservation it made).
        if state == IN_PROGRESS and value[42:50] == nonce:
            return Acquired(token=HEADER.unpack_from(value)[2])
        return None
    record = _record(value, scope, None, False)
    if record is None:  # a tombstone: the script makes the new record past its token
        return None
    if state == IN_PROGRESS and value[42:50] == nonce:
        return Acquired(token=record.token, recovery_point=record.recovery_point)
    if now is None:
        if clock != REDIS_CLOCK or state == IN_PROGRESS:
            return None
        # On Redis's clock the key expires when the retention ends: this one is inside it.
        return Replay(record) if record.fingerprint == fingerprint else Mismatch(record)
    return judge(record, fingerprint, now)


def reservation(reply: Any, scope: Scope, fingerprint: str, now: datetime | None) -> Reservation:
    """What the reserve script answered (lua/reserve.lua lists the shapes), judged against
    the ``now`` it decided with: the caller's, or Redis's TIME that the script answers."""
    kind = int(reply[0])
    if kind == 1:
        token, point = int(reply[1]), reply[2]
        TokenClock.seen(token)
        return Acquired(
            token=token,
            recovery_point=point.decode() if isinstance(point, bytes) else None,
            taken_over=bool(int(reply[3])),
        )
    if kind == 2:
        why = reply[1].decode() if isinstance(reply[1], bytes) else reply[1]
        raise corrupt(scope, why)
    _, at, value, expiry = reply
    stored = decode(value, scope, int(expiry))
    if stored.record is None:
        raise StoreError(f"{key_ref(scope.key)}: the reserve script answered a tombstone")
    verdict = judge(stored.record, fingerprint, now or _time(int(at)))
    if verdict is None:  # the script takes over whatever judge would
        raise StoreError(f"{key_ref(scope.key)}: the reserve script answered a free record")
    return verdict


def upgraded(reply: Any, scope: Scope) -> bytes:
    """The upgrade script's answer: the record's new value."""
    if int(reply[0]) == 2:
        why = reply[1].decode() if isinstance(reply[1], bytes) else reply[1]
        raise corrupt(scope, why)
    value: bytes = reply[1]
    return value


def fenced(done: Any, scope: Scope, token: int) -> int:
    """A settle's or renewal's answer: 0 means the token no longer holds the record; else the
    end of the record's retention (µs)."""
    if not int(done):
        raise FencedError(f"{key_ref(scope.key)}: token {token} is stale")
    return int(done)


def wrong_type(reply: Any) -> bool:
    """Whether a command's reply is Redis's WRONGTYPE error: a key of another type (a record
    of the previous layout is a hash)."""
    return isinstance(reply, Exception) and str(reply).startswith("WRONGTYPE")


def listed_record(value: Any, expiry_ms: Any) -> Record | None:
    """The record (without its response) from the first `LISTED_BYTES` of a value; None for a
    key that holds no record (another type, a tombstone, bytes idempo cannot read)."""
    if not isinstance(value, bytes):
        return None
    try:
        stored = decode(value, None, expiry_ms if isinstance(expiry_ms, int) else None)
    except (ValueError, IndexError):
        return None
    if stored.record is None:
        return None
    return dataclasses.replace(stored.record, response=None)


def listed_whole(value: Any) -> bool:
    """Whether the first `LISTED_BYTES` of a value hold all its strings (else it is read
    whole)."""
    if not isinstance(value, bytes) or len(value) < LISTED_BYTES:
        return True
    try:
        *_, fpn, rpn, pn, on, kn = HEADER.unpack_from(value)
    except struct.error:
        return True
    strings: int = (fpn & 0x7FFF) + max(rpn - 1, 0) + pn + on + kn
    return HEADER_SIZE + strings <= len(value)


def page(reply: Any) -> tuple[int, list[Any]]:
    """A SCAN reply as (next cursor, keys); a cluster client answers the cursor as
    ``{node name: cursor}`` for the one node it asked."""
    cursor, keys = reply
    if isinstance(cursor, dict):
        (cursor,) = cursor.values()
    return int(cursor), list(keys)


def count(states: list[Any], counts: dict[str, int]) -> None:
    """Add to ``counts`` the records per state from one-byte GETRANGE replies; tombstones and
    keys holding something else are skipped."""
    for state in states:
        status = _STATUSES.get(state) if isinstance(state, bytes) else None
        if status is not None:
            counts[status.value] = counts.get(status.value, 0) + 1


def redis_now(reply: Any) -> int:
    """A TIME reply in µs (a cluster client answers it per node)."""
    if isinstance(reply, dict):
        reply = next(iter(reply.values()))
    seconds, us = reply
    return int(seconds) * 1_000_000 + int(us)
