"""Redis store: one string per record; a fresh reservation and a replay are one plain command.

    RedisStore("redis://127.0.0.1:6379/0")            # or RedisStore(client=redis.Redis(...))
    AsyncRedisStore("rediss://cache:6380/1", prefix="payments")
    RedisStore("redis+cluster://10.0.0.1:7000,10.0.0.2:7000/0")   # or client=RedisCluster(...)

**Keys.** A record lives in one string at ``<prefix>:{<sha256 hex>}``, the digest taken over
the scope (principal, operation, key). User strings never appear in key names; they are kept
inside the record. The braces are a Redis Cluster hash tag, and every command and script
touches that one key only, so on a cluster each call goes whole to the node that owns the
record's slot. Records on a clock the caller gave are also listed in ``<prefix>:expiring`` (a
sorted set, by when each may be purged), with commands of their own.

**The record** (`_protocol`, lua/common.lua): a 59-byte header (state, clock, token, created,
updated, lease end and retention end in µs, the reservation's nonce, five lengths), then the
fingerprint (64 hex digits as their 32 bytes), the recovery point, the principal, the
operation, the key and, once settled, the response bytes.

**Atomicity.** A reservation is ``SET key <record> NX GET PX <ttl>``: Redis answers nothing
when it created ours (acquired: one round trip), or the record already there, which the
caller judges when it can without Redis's clock (a settled record on Redis's clock: replay or
mismatch; one on the caller's clock: `judge` at its ``now``; the reservation it made itself).
Anything else (a record in progress, a released key, a record on another clock, one of the
previous layout) goes to the reserve script, which takes over an ended lease or retention,
or hands the record back with the ``now`` it judged at. complete/fail, renew/checkpoint,
release, evict and purge are each one Lua script; every write after reservation is fenced on
the token. Every command is safe to run twice, since redis-py re-sends a command whose
connection broke (ten times for a client built by hand, once for the clients this module
builds from a URL), so a lost reply may mean a command ran twice: each reserve carries a
fresh nonce inside its record, and a re-sent reserve that finds its own reservation gets the
same token back rather than "in progress"; a repeated complete/fail with the same token,
status and response succeeds without a change; a repeated renew extends the lease again; a
repeated release finds nothing, because tokens are never reused. A reserve whose answer the
async store never got (the caller was cancelled, or the connection failed) is undone by its
nonce, so it does not hold the key for a lease with no one to settle it: a reservation is
released, and one that took over an attempt's committed steps (a recovery point) keeps them,
with its lease ended and its token fenced out (lua/release.lua). A cancelled caller waits
for that undo, shielded and bounded as the guard's cleanup is; on the store's own client
the undo leaves once the cancelled command's reply has been read, so it reaches Redis after
that command. So the guard awaits a reservation on such a store in the caller's own task,
without the task of its own that shields every other store call. After a connection
failure the undo runs in the background (a command still on its way that reaches Redis
after it holds the key until its lease ends); `AsyncRedisStore.aclose` waits for those
undos. The guard's shield does not make the undo redundant: it cannot release a
reservation whose reply was lost, and it gives up on a store that has not answered within
its bound.

**Time.** ``now=None`` (the default policy) means Redis's clock. A fresh reservation, a plain
``SET``, stores its lease and its key's PX as durations, and its times are derived from the
key's expiry (``PEXPIRETIME``, which Redis set from its own clock); every script reads TIME
and stores absolute times, but the settle, stamped with the caller's estimate of Redis's
clock (`_protocol.TokenClock`, never ahead of it, never before the record's last change).
On Redis's clock a key expires exactly when the record's retention ends, so a key Redis
still holds is inside its retention: a replay needs no clock.
Leases, retention, takeovers and `purge` (``before=None``) all use the clock of the node that
holds the record, so a caller whose own clock is wrong cannot take over a live lease. Redis 7
replicates a script's effects, not the script, so a replica stores the primary's times. A
datetime ``now`` is a clock the app injected (tests, simulations) and is used instead: its
times are stored as given, and the key expires that long after ``now`` plus a grace period
(``expiry_grace``, default one minute).

**Tokens.** A takeover's token is ``max(old token + 1, Redis's TIME in µs)``, computed in the
reserve script. A release or evict leaves a tombstone with the record's token until the
record's retention ends, and the next reservation takes it over with a token past it. A
reservation of a key that is gone altogether (expired, purged, evicted under maxmemory) is a
plain SET whose token this process chose: its estimate of Redis's clock in µs (`TokenClock`),
past every token it handed out before. So a holder stalled past its lease and the retention
holds a token no later holder has, as long as Redis's clock does not step back, nor the
estimate err, by more than the time between the two reservations.

**Purge.** Redis deletes records on its clock by itself as their retention ends. `purge` reads
the records on a given clock from ``<prefix>:expiring``, oldest first, and deletes up to
``limit`` whose retention (and any lease) ended by ``before``, each re-checked by a script; a
``before`` later than Redis's clock also sweeps the keyspace with a SCAN that goes on where
the store's last sweep stopped.

**Faults.** Connection errors and timeouts (and, on a cluster, a cluster that is down, has
uncovered slots or cannot be reached at all) raise `StoreUnavailableError` (the guard then runs
nothing); a key that holds something idempo cannot read (bytes another program wrote, a
header or length that does not add up, another type) raises `CorruptRecordError` from reserve
and get until it is evicted (settles and renews by any token are fenced, purge and stats walk
past it); any other Redis error raises `StoreError`. A record of the previous layout (a hash)
is converted in place the first time a reserve, get or evict reads it. Redis is a *leased*
store only: the business writes and the record never commit together, so it has no ``bind``.

**Waiting.** `wait_settled` (what a duplicate told to wait, ``Policy.wait``, calls)
subscribes to the record's key name, then marks the record (lua/mark.lua: a fresh
reservation becomes a record on Redis's clock) and learns whether it is still in progress.
The settle of an unmarked fresh reservation publishes nothing; every other settle, release
and ended lease publishes on the key name: the duplicate replays as soon as the first
attempt settles.

`stats` counts records per state with a SCAN over the prefix: fine for tests and the CLI,
not for a hot path on a large keyspace.

**Inside.** The logic is written once, without I/O: `_protocol` (key names, the record's
bytes, arguments, replies), `_ops` (each verb as a generator that yields the calls it needs:
this command, or this script on these keys with these arguments, and receives the replies)
and the Lua scripts, package data in ``lua/`` (`_scripts` reads them). `RedisStore` (`_sync`)
and `AsyncRedisStore` (`_async`) only carry the calls out, each with its client; `_errors`
and `_connect` serve both.
"""

from __future__ import annotations

from ._async import AsyncRedisStore
from ._sync import RedisStore

__all__ = ["AsyncRedisStore", "RedisStore"]

# The public home of both classes (help(), reprs, documentation tools).
AsyncRedisStore.__module__ = RedisStore.__module__ = __name__
