"""Fresh calls/s as concurrent clients grow from 1 to 64, in several processes, on
PostgreSQL and Redis: throughput should climb until the machine is saturated and then stay
flat, never drop (issue 15's "no drop past saturation").

    .venv/bin/python bench/concurrency.py [--seconds 3] [--stores postgres,redis]

Each level runs ``clients`` threads spread over up to ``--processes`` worker processes (so
the GIL of one process is not what saturates), all starting together; each thread makes
fresh-key calls of ``Idempotency(store).once`` around a trivial body for ``--seconds``.
Every process has one store (one connection pool, sized for its threads). Prints calls/s per
level and each level's ratio to the best level below it: past saturation the ratio should
stay near 1.0.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import secrets
import threading
import time
from typing import Any

POSTGRES = "postgresql://postgres@127.0.0.1:5432/test"
REDIS = "redis://127.0.0.1:6379/0"
LEVELS = (1, 2, 4, 8, 16, 32, 64)


def _open(kind: str, threads: int, place: str) -> Any:
    if kind == "postgres":
        from idempo.stores.postgres import PostgresStore

        return PostgresStore(POSTGRES, table=f"{place}.idempo_records", max_size=threads)
    from idempo.stores.redis import RedisStore

    return RedisStore(REDIS, prefix=place, max_connections=threads)


def _worker(kind: str, place: str, threads: int, ready: Any, seconds: float, results: Any) -> None:
    from idempo import Idempotency

    store = _open(kind, threads, place)
    idem = Idempotency(store)
    counts = [0] * threads
    tag = secrets.token_hex(4)
    started = threading.Barrier(threads + 1)

    def run(slot: int) -> None:
        with idem.once(f"{tag}-{slot}-warm", operation="bench") as attempt:
            attempt.result = 0  # connected and warm before the start
        started.wait()
        deadline = time.monotonic() + seconds
        n = 0
        while time.monotonic() < deadline:
            with idem.once(f"{tag}-{slot}-{n}", operation="bench") as attempt:
                attempt.result = n
            n += 1
        counts[slot] = n

    pool = [threading.Thread(target=run, args=(slot,)) for slot in range(threads)]
    for thread in pool:
        thread.start()
    ready.wait()  # every process's threads are warm: all start together
    started.wait()
    for thread in pool:
        thread.join()
    store.close()
    results.put(sum(counts))


def _level(kind: str, place: str, clients: int, processes: int, seconds: float) -> float:
    procs = min(clients, processes)
    spread = [clients // procs + (1 if i < clients % procs else 0) for i in range(procs)]
    context = mp.get_context("spawn")
    ready, results = context.Barrier(procs), context.Queue()
    workers = [
        context.Process(target=_worker, args=(kind, place, n, ready, seconds, results))
        for n in spread
    ]
    for worker in workers:
        worker.start()
    total = sum(results.get() for _ in workers)
    for worker in workers:
        worker.join()
    return total / seconds


def _prepare(kind: str) -> tuple[str, Any]:
    """A place of this run's own (a PostgreSQL schema, a Redis prefix) and its cleanup."""
    place = f"idempo_conc_{secrets.token_hex(4)}"
    if kind == "postgres":
        import psycopg

        from idempo.stores.postgres import PostgresStore

        with psycopg.connect(POSTGRES, autocommit=True) as conn:
            conn.execute(f"CREATE SCHEMA {place}")
        store = PostgresStore(POSTGRES, table=f"{place}.idempo_records")
        store.migrate()
        store.close()

        def clean() -> None:
            with psycopg.connect(POSTGRES, autocommit=True) as conn:
                conn.execute(f"DROP SCHEMA {place} CASCADE")

        return place, clean
    import redis

    def clean_redis() -> None:
        client = redis.Redis.from_url(REDIS)
        for batch in _batches(client.scan_iter(match=f"{place}*", count=10_000)):
            client.delete(*batch)
        client.close()

    return place, clean_redis


def _batches(keys: Any, size: int = 1000) -> Any:
    batch: list[Any] = []
    for key in keys:
        batch.append(key)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--stores", default="postgres,redis")
    args = parser.parse_args()
    for kind in args.stores.split(","):
        place, clean = _prepare(kind)
        try:
            print(f"{kind}: fresh calls/s by concurrent clients ({args.seconds:g} s each)")
            best = 0.0
            for clients in LEVELS:
                rate = _level(kind, place, clients, args.processes, args.seconds)
                ratio = f"{rate / best:5.2f}x the best below" if best else ""
                print(f"  {clients:>3} clients {rate:>9.0f} calls/s  {ratio}")
                best = max(best, rate)
        finally:
            clean()


if __name__ == "__main__":
    main()
