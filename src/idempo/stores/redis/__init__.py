"""Redis store: one hash per record, every state transition one Lua script.

    RedisStore("redis://127.0.0.1:6379/0")            # or RedisStore(client=redis.Redis(...))
    AsyncRedisStore("rediss://cache:6380/1", prefix="payments")
    RedisStore("redis+cluster://10.0.0.1:7000,10.0.0.2:7000/0")   # or client=RedisCluster(...)

**Keys.** A record lives in one hash at ``<prefix>:{<sha256 hex>}``, the digest taken over the
scope (principal, operation, key). User strings never appear in key names; they are kept
inside the hash. The braces are a Redis Cluster hash tag, and every script touches that one
key only, so on a cluster each call goes whole to the node that owns the record's slot.

**Cluster.** A ``redis.cluster.RedisCluster`` (``redis.asyncio.cluster.RedisCluster``) client,
or a ``redis+cluster://`` / ``rediss+cluster://`` URL listing one or more seed nodes, runs the
same scripts: redis-py routes each by its key's slot and follows MOVED/ASK redirections.
`purge` and `stats` SCAN every primary in turn. Cluster pipelines refuse scripts, so on a
cluster `purge` runs its script once per key (a round trip each) instead of pipelining.

**Atomicity.** reserve, complete/fail, release and renew are each one Lua script (EVALSHA):
create the record, take over an expired lease or retention, or hand the existing record back
to the caller, who judges it with `judge` against the ``now`` the script decided with. A
replay is one round trip; a fresh call is two (reserve, then settle). Every write after
reservation is fenced on the token. Every script is safe to run twice, since redis-py re-sends
a command whose connection broke (ten times for a client built by hand, once for the
clients this module builds from a URL), so a lost reply may mean a command ran twice: each
reserve carries a fresh nonce, and a re-sent reserve that finds its own reservation gets the
same token back rather than "in progress"; a repeated complete/fail with the same token,
status and response succeeds without a change; a repeated renew extends the lease again; a
repeated release finds nothing, because tokens are never reused. A reserve whose answer the
async store never got (the caller was cancelled, or the connection failed) is undone in the
background by its nonce, so it does not hold the key for a lease with no one to settle it
(unless its command was still on its way and reaches Redis after the undo: then its lease
frees the key); `AsyncRedisStore.aclose` waits for those undos. The guard's own shield
(every store call of a cancelled caller runs to its end) does not make this redundant: it
cannot release a reservation whose reply was lost, and it gives up on a store that has not
answered within its bound.

**Tokens.** A token is ``max(old token + 1, Redis's TIME in microseconds)``, computed in the
script. A takeover gets a larger one, and so does a record created after the previous one was
deleted (released, purged, expired by its TTL, evicted under maxmemory, `evict`), so a holder
stalled past its lease and the retention holds a token no later holder has, as long as the
server's clock does not step back by more than the time between the two reservations.

**Time.** ``now=None`` (the default policy) means Redis's clock: the scripts read TIME
themselves, so leases, retention, takeovers, `purge` (``before=None``) and the TTLs all use
the one clock of the node that holds the record, and a caller whose own clock is wrong
cannot take over a live lease. Redis 7 replicates a script's effects, not the script, so a
replica stores the primary's times. A datetime ``now`` is a clock the app injected (tests,
simulations) and is used instead; tokens still come from TIME. Times travel and are stored as
integer microseconds since the epoch; lease and retention go to the scripts as durations.

**Retention.** Each write sets the key's TTL with PEXPIRE to ``expires_at - now`` plus a grace
period (``expiry_grace``, default one minute), so Redis deletes records by itself shortly after
their retention ends. `purge` is therefore a safety net rather than a necessity: it walks the
prefix with a bounded SCAN and deletes, with a script per record that re-checks it, up to
``limit`` records whose retention ended by ``before`` (an in-progress record also needs its
lease over), which is what Redis has not expired yet.

**Faults.** Connection errors and timeouts (and, on a cluster, a cluster that is down, has
uncovered slots or cannot be reached at all) raise `StoreUnavailableError` (the guard then runs
nothing); a key that holds something idempo cannot read (a hash another program wrote, a
missing or malformed field, another type) raises `CorruptRecordError` from reserve and get
until it is evicted (settles and renews by any token are fenced, purge and stats walk past
it); any other Redis error raises `StoreError`. Redis is a *leased* store only: the business
writes and the record never commit together, so it has no ``bind``.

`stats` counts records per state with a SCAN over the prefix: fine for tests and the CLI,
not for a hot path on a large keyspace.

**Inside.** The logic is written once, without I/O: `_protocol` (key names, script arguments,
replies), `_ops` (each verb as a generator that yields the calls it needs: run this script on
this key with these arguments, and receives the replies) and the Lua scripts, package data
in ``lua/`` (`_scripts` reads them). `RedisStore` (`_sync`) and `AsyncRedisStore` (`_async`)
only carry the calls out, each with its client; `_errors` and `_connect` serve both.
"""

from __future__ import annotations

from ._async import AsyncRedisStore
from ._sync import RedisStore

__all__ = ["AsyncRedisStore", "RedisStore"]

# The public home of both classes (help(), reprs, documentation tools).
AsyncRedisStore.__module__ = RedisStore.__module__ = __name__
