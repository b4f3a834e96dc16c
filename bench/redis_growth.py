"""The Redis store at scale: memory per record, latency as the keyspace grows, and purge.

Records are loaded through the store's own operations (`idempo.stores.redis._ops`, the same
flows `RedisStore` drives), many at a time in one pipeline per step, so the bench writes
exactly what the store writes, whatever its layout, at pipelined speed. Every key lives under
a prefix of this run's own, deleted at the end (also after a failure).

1. **Memory.** ``used_memory`` before and after loading ``--records`` completed records (on
   Redis's clock, a ``--response-bytes`` response each), per record.
2. **Latency as the keyspace grows.** p50/p99 of a fresh call (reserve, complete: the store's
   verbs, one call at a time) and of a replay (reserve of a completed record, a random one of
   those loaded) on a keyspace of ``--records`` and on one of 10⁴ (in database ``--small-db``
   of the same server), in rounds that alternate between the two, so the machine's load
   falls on both alike.
3. **Purge.** ``--purge-records`` more records (default: ``--records``), completed on a clock
   two days back, so their retention is over, purged the way ``idempo purge`` does
   (``purge_records``: batches of 1000 until a short one, resting ``--rest`` times each
   batch's time between batches), records/s. Meanwhile a second process makes paced live
   calls (a fresh call every 2 ms) under the same prefix; the purge pauses for a second
   after every second of purging, and the p99 of the calls made while it purged is
   compared with the p99 of those made in its pauses (bench/_purge_windows.py). Then one
   more ``purge()`` over the keyspace where nothing is expired: how long a purge that finds
   nothing takes.

Usage: python bench/redis_growth.py [--records N] [--purge-records N] [--url URL]
                                    [--response-bytes B] [--rest R] [--quick]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import secrets
import statistics
import time
from collections.abc import Generator, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis

from _purge_windows import PurgeWindows, purge_as_cli
from _report import report
from idempo import Scope, Status
from idempo._core.record import Acquired, Replay
from idempo.stores.redis import RedisStore, _ops
from redis_store import cleanup

DEFAULT_URL = "redis://127.0.0.1:6379/0"
RUN_ID = secrets.token_hex(4)
PREFIX = f"idempo-growth-{RUN_ID}"
LEASE = timedelta(seconds=30)
TTL = timedelta(hours=24)
PIPELINE = 1000  # flows stepped together, one pipeline per step
SAMPLES = 2000  # latency samples per measurement
SMALL = 10_000
SMALL_DB = 15  # the 10^4 keyspace: a database of its own beside the URL's (``--small-db``)
ROUNDS = 10
PURGE_LIMIT = 1000
LIVE_EVERY_S = 0.002
WINDOW_S = 1.0  # the purge pauses this long after every this long (bench/_purge_windows.py)
# Issue 15's goals, reported to `make bench`'s table (bench/_report.py).
GROWTH_GOAL = 0.9  # calls/s at --records over calls/s at 10^4
LIVE_GOAL = 1.2  # live p99 during a purge over the quiet windows', at most


def scope(n: int, kind: str = "live") -> Scope:
    return Scope.of(f"{kind}-{n}", operation="POST /payments", principal=f"tenant-{n % 97}")


def fingerprint(n: int) -> str:
    return f"{n:064x}"


# --------------------------------------------------------------------------- loading


def _add(pipe: Any, store: RedisStore, call: Any) -> int:
    """Queue one call of a flow on ``pipe``; how many replies it will take."""
    if isinstance(call, _ops.Batch):
        for each in call.calls:
            _add(pipe, store, each)
        return len(call.calls)
    if isinstance(call, _ops.Run):
        keys = getattr(call, "keys", None) or [call.key]
        store._scripts[call.script](keys=keys, args=call.args, client=pipe)
        return 1
    assert isinstance(call, _ops.Command), call
    getattr(pipe, call.name)(*call.args, **call.options)
    return 1


def drive_many(store: RedisStore, flows: list[Generator[Any, Any, Any]]) -> list[Any]:
    """Run ``flows`` side by side: each step sends every flow's next call in one pipeline."""
    results: list[Any] = [None] * len(flows)
    pending = []
    for index, flow in enumerate(flows):
        pending.append((index, flow, next(flow)))
    while pending:
        pipe = store.client.pipeline(transaction=False)
        sizes = [_add(pipe, store, call) for _, _, call in pending]
        replies = pipe.execute()
        following = []
        start = 0
        for (index, flow, call), size in zip(pending, sizes, strict=True):
            reply = (
                replies[start]
                if not isinstance(call, _ops.Batch)
                else replies[start : start + size]
            )
            start += size
            try:
                following.append((index, flow, flow.send(reply)))
            except StopIteration as stop:
                results[index] = stop.value
        pending = following
    return results


def completed(
    store: RedisStore, s: Scope, fp: str, body: bytes, now: datetime | None
) -> Generator[Any, Any, None]:
    """One record, reserved and completed, as the guard leaves a fresh call."""
    reservation = yield from _ops.reserve(store._keys, s, fp, now, LEASE, TTL)
    assert isinstance(reservation, Acquired), reservation
    yield from _ops.settle(store._keys, s, reservation.token, Status.COMPLETED, body, now, TTL)


def load(
    store: RedisStore, start: int, stop: int, kind: str, body: bytes, now: datetime | None
) -> None:
    for first in range(start, stop, PIPELINE):
        flows = [
            completed(store, scope(n, kind), fingerprint(n), body, now)
            for n in range(first, min(stop, first + PIPELINE))
        ]
        drive_many(store, flows)


# --------------------------------------------------------------------------- measuring


def used_memory(client: redis.Redis) -> int:
    info: Any = client.info("memory")
    return int(info["used_memory"])


def percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered), ordered[int(len(ordered) * 0.99) - 1]


_fresh_serial = iter(range(10**9))


def fresh_latencies(store: RedisStore, body: bytes, samples: int) -> list[float]:
    out = []
    for _ in range(samples):
        s = scope(next(_fresh_serial), "fresh")
        started = time.perf_counter_ns()
        reservation = store.reserve(s, "fp", now=None, lease=LEASE, ttl=TTL)
        assert isinstance(reservation, Acquired), reservation
        store.complete(s, reservation.token, body, now=None, ttl=TTL)
        out.append((time.perf_counter_ns() - started) / 1000)
    return out


def replay_latencies(store: RedisStore, loaded: int, samples: int) -> list[float]:
    out = []
    for _ in range(samples):
        n = random.randrange(loaded)
        started = time.perf_counter_ns()
        verdict = store.reserve(scope(n), fingerprint(n), now=None, lease=LEASE, ttl=TTL)
        out.append((time.perf_counter_ns() - started) / 1000)
        assert isinstance(verdict, Replay), verdict
    return out


def latencies(stores: dict[int, RedisStore], body: bytes) -> dict[int, dict[str, float]]:
    """Fresh calls and replays on each keyspace (size: its store), in rounds that alternate
    between them so that the machine's load falls on each alike; prints p50/p99 per size and
    kind, returns the median µs per size and kind (a mean on this shared machine is the
    scheduler's stalls, not the keyspace)."""
    samples: dict[int, dict[str, list[float]]] = {n: {"fresh": [], "replay": []} for n in stores}
    per_round = SAMPLES // ROUNDS
    for round_ in range(ROUNDS):
        order = list(stores.items())
        for size, store in order[round_ % 2 :] + order[: round_ % 2]:
            samples[size]["fresh"] += fresh_latencies(store, body, per_round)
            samples[size]["replay"] += replay_latencies(store, size, per_round)
    for size, kinds in samples.items():
        line = f"  {size} records".ljust(18)
        for kind, values in kinds.items():
            p50, p99 = percentiles(values)
            line += f" {kind} p50 {p50:7.0f} µs  p99 {p99:7.0f} µs  "
        print(line.rstrip())
    return {n: {k: statistics.median(v) for k, v in kinds.items()} for n, kinds in samples.items()}


# --------------------------------------------------------------------------- the live caller


def live_main(url: str, stop: Any, out: Any, prefix: str) -> None:
    """A second process: a paced fresh call every LIVE_EVERY_S; (start time, µs) per call.
    Under the parent's ``prefix``, so that its cleanup deletes these keys too (a spawned
    process draws a RUN_ID of its own)."""
    store = RedisStore(url, prefix=prefix)
    samples: list[tuple[float, float]] = []
    body = b'{"id":"live"}'
    n = 0
    try:
        next_at = time.monotonic()
        while not stop.is_set():
            s = scope(n, "ongoing")
            n += 1
            started = time.monotonic()
            reservation = store.reserve(s, "fp", now=None, lease=LEASE, ttl=TTL)
            assert isinstance(reservation, Acquired), reservation
            store.complete(s, reservation.token, body, now=None, ttl=TTL)
            samples.append((started, (time.monotonic() - started) * 1e6))
            next_at += LIVE_EVERY_S
            pause = next_at - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            else:
                next_at = time.monotonic()
    finally:
        store.close()
        out.put(samples)


@contextmanager
def live_caller(url: str) -> Iterator[list[tuple[float, float]]]:
    context = multiprocessing.get_context("spawn")
    stop, out = context.Event(), context.Queue()
    process = context.Process(target=live_main, args=(url, stop, out, PREFIX))
    process.start()
    samples: list[tuple[float, float]] = []
    try:
        yield samples
    finally:
        stop.set()
        samples.extend(out.get(timeout=120))
        process.join(30)


# --------------------------------------------------------------------------- main


def db_of(url: str) -> int:
    return int(urlsplit(url).path.strip("/") or 0)


def with_db(url: str, db: int) -> str:
    return urlunsplit(urlsplit(url)._replace(path=f"/{db}"))


def run(
    url: str,
    records: int,
    expired: int,
    response_bytes: int,
    rest: float,
    small_db: int,
    batch_time: float | None = None,
) -> None:
    body = (b'{"id":"' + b"x" * response_bytes)[: max(response_bytes - 2, 0)] + b'"}'
    body = body[:response_bytes]
    if small_db == db_of(url):
        raise SystemExit(f"--small-db must differ from the URL's database ({small_db})")
    store = RedisStore(url, prefix=PREFIX)
    small_url = with_db(url, small_db)
    small_store = RedisStore(small_url, prefix=PREFIX)
    client = store.client
    info: Any = client.info("server")
    small = min(SMALL, records // 10)
    print(
        f"Redis {info['redis_version']} at {url}; {records} records, responses of"
        f" {len(body)} bytes; idempo from {os.path.dirname(_ops.__file__)}"
    )
    try:
        before = used_memory(client)
        started = time.perf_counter()
        load(store, 0, records, "live", body, None)
        loaded_s = time.perf_counter() - started
        grown = used_memory(client) - before
        load(small_store, 0, small, "live", body, None)
        print(
            f"latency (the store's verbs, one call at a time; {ROUNDS} rounds, alternating"
            f" between {records} records in db {db_of(url)} and {small} in db {db_of(small_url)}):"
        )
        means = latencies({small: small_store, records: store}, body)
        for kind in ("fresh", "replay"):
            path = f"redis {kind}: at {records:,} records / at {small:,}"
            report("growth", path, means[small][kind] / means[records][kind], GROWTH_GOAL)
        print(
            f"memory: {grown / records:.0f} bytes per record (used_memory +{grown / 2**20:.1f} MiB"
            f" for {records} records, loaded at {records / loaded_s:,.0f} records/s)"
        )
        path = f"redis memory per record, bytes ({len(body)}-byte responses)"
        report("growth", path, grown / records, None, unit="", lower_is_better=True)

        past = datetime.now(UTC) - timedelta(days=2)
        load(store, 0, expired, "expired", body, past)
        windows = PurgeWindows(WINDOW_S)
        with live_caller(url) as samples:
            time.sleep(WINDOW_S)
            purged = purge_as_cli(store, None, batch_time, rest, sleep=windows.sleep)
            windows.close()
        during, quiet = windows.split(samples)
        purge_s = windows.purging_seconds()
        print(
            f"purge: {purged} expired records in {purge_s:.2f} s of purging,"
            f" {purged / purge_s:,.0f} records/s (batch time {batch_time}, rest {rest:g};"
            f" paused {WINDOW_S:g} s after every {WINDOW_S:g} s)"
        )
        ratio = percentiles(during)[1] / percentiles(quiet)[1]
        print(
            f"live p99: {percentiles(during)[1]:.0f} µs while purging ({len(during)} calls),"
            f" {percentiles(quiet)[1]:.0f} µs in the pauses between ({len(quiet)} calls):"
            f" {ratio:.2f}x"
        )
        path = f"redis purge of {purged:,} expired, records/s (rest {rest:g})"
        report("growth", path, purged / purge_s, None, unit="")
        path = f"redis fresh: live p99 during a purge / between, {records:,} records"
        report("growth", path, ratio, LIVE_GOAL, lower_is_better=True)
        started = time.perf_counter()
        nothing = store.purge(before=None, limit=PURGE_LIMIT)
        nothing_ms = (time.perf_counter() - started) * 1000
        print(
            f"a purge that finds nothing ({nothing} purged) over {records} live records:"
            f" {nothing_ms:.1f} ms"
        )
        path = f"redis purge finding nothing, {records:,} records, ms"
        report("growth", path, nothing_ms, None, unit="")
    finally:
        store.close()
        small_store.close()
        deleted = cleanup(url, PREFIX) + cleanup(small_url, PREFIX)
        print(f"cleanup: deleted {deleted} keys under {PREFIX}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--url", default=DEFAULT_URL, help="Redis URL (default: %(default)s)")
    parser.add_argument("--records", type=int, default=1_000_000, help="default: %(default)s")
    parser.add_argument(
        "--purge-records", type=int, help="expired records to purge (default: --records)"
    )
    parser.add_argument(
        "--response-bytes", type=int, default=100, help="each record's response (default: 100)"
    )
    parser.add_argument(
        "--rest",
        type=float,
        default=1.0,
        help="idempo purge's rest between batches, times the batch's time (0: flat out)",
    )
    parser.add_argument(
        "--batch-time",
        type=float,
        help="idempo purge's --batch-time, seconds (default: the store's; 0: fixed batches)",
    )
    parser.add_argument(
        "--small-db",
        type=int,
        default=SMALL_DB,
        help="the database of the 10^4 keyspace, beside the URL's (default: %(default)s)",
    )
    parser.add_argument("--quick", action="store_true", help="at most 10^5 records")
    args = parser.parse_args()
    if args.quick:
        args.records = min(args.records, 100_000)
        args.purge_records = min(args.purge_records or args.records, 100_000)
    expired = args.purge_records or args.records
    run(
        args.url,
        args.records,
        expired,
        args.response_bytes,
        args.rest,
        args.small_db,
        args.batch_time,
    )


if __name__ == "__main__":
    main()
