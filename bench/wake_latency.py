"""How long a duplicate told to wait (``Policy.wait``) takes to replay once the first attempt
completes: woken by the store (``wait_settled``) against polling every 50 ms, measured in the
same run, on the memory store and on PostgreSQL (LISTEN/NOTIFY; a scratch schema), where the
duplicate also runs in transactional mode on a connection of the app's (``conn=``): against a
first attempt in leased mode (a committed record in progress), and against a transactional
one held past the duplicate's lock timeout (its row-lock wait ends, and it waits on).

    .venv/bin/python bench/wake_latency.py [--rounds 40] [--dsn URL] [--no-postgres]

Each round: a first attempt holds a key, a duplicate starts waiting, the first completes at
a moment that falls anywhere within a poll interval; the time from the completion to the
duplicate's replay is one sample. Prints the median and p95 of each, and their ratio.
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time
from contextlib import ExitStack
from datetime import timedelta
from typing import Any

import psycopg

from _measure import scratch_postgres_store
from _report import report
from idempo import Idempotency, Policy
from idempo.stores.memory import MemoryStore
from idempo.stores.postgres import PostgresStore

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/test"


class PollingStore(MemoryStore):
    """The memory store without ``wait_settled`` (the flow then polls): what every store
    was before."""

    wait_settled = None  # type: ignore[assignment]


class PollingPostgresStore(PostgresStore):
    """PostgreSQL without ``wait_settled``, as it was before."""

    wait_settled = None  # type: ignore[assignment]


class Face:
    """How a round's two attempts reach ``store``: on the store's own connections, or, where
    given, on a connection of the app's (``conn=``, transactional mode)."""

    def __init__(self, store: Any, *, first: Any = None, duplicate: Any = None) -> None:
        self.store = store
        self.first = first
        self.duplicate = duplicate
        # A transactional first attempt holds its row lock past the duplicate's lock timeout
        # (50 ms, from 50 to 250 ms): the duplicate's row-lock wait ends at least once, and
        # the first completes during a row-lock wait or during what follows it.
        self.lock_timeout = timedelta(seconds=5 if first is None else 0.05)
        self.hold = (0.02, 0.05) if first is None else (0.05, 0.2)


def one_round(face: Any, key: str) -> float:
    if not isinstance(face, Face):
        face = Face(face)
    policy = Policy(wait=timedelta(seconds=10), lock_timeout=face.lock_timeout)
    idem = Idempotency(face.store, policy)
    replayed_at: list[float] = []
    waiting = threading.Event()

    def duplicate() -> None:
        waiting.set()
        with idem.once(key, operation="bench", conn=face.duplicate) as attempt:
            assert attempt.replayed
            replayed_at.append(time.perf_counter())

    with idem.once(key, operation="bench", conn=face.first) as first:
        thread = threading.Thread(target=duplicate)
        thread.start()
        waiting.wait()
        least, spread = face.hold
        time.sleep(least + random.random() * spread)  # the duplicate is waiting by now
        first.result = "done"
    completed_at = time.perf_counter()  # the block's exit completed the record
    thread.join()
    return replayed_at[0] - completed_at


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--dsn", default=DEFAULT_DSN)
    parser.add_argument("--no-postgres", action="store_true")
    args = parser.parse_args()
    with ExitStack() as stack:
        families = {"memory store": {"woken": MemoryStore(), "polling": PollingStore()}}
        if not args.no_postgres:
            woken = scratch_postgres_store(stack, args.dsn)
            polling = scratch_postgres_store(stack, args.dsn, PollingPostgresStore)
            families["PostgreSQL"] = {"woken": woken, "polling": polling}
            conns = [stack.enter_context(psycopg.connect(args.dsn)) for _ in range(4)]
            for name, first in [("a leased first", False), ("a transactional first", True)]:
                app = conns[:2] if first else [None, None]
                families[f"PostgreSQL, conn= duplicate, {name}"] = {
                    "woken": Face(woken, first=app[0], duplicate=conns[2]),
                    "polling": Face(polling, first=app[1], duplicate=conns[3]),
                }
        for family, faces in families.items():
            measure(family, faces, args.rounds)


def measure(family: str, faces: dict[str, Any], rounds: int) -> None:
    samples: dict[str, list[float]] = {name: [] for name in faces}
    for n in range(rounds):
        for name in random.sample(list(faces), len(faces)):  # interleaved, in a random order
            samples[name].append(one_round(faces[name], f"{family.replace(' ', '_')}-{name}-{n}"))
    print(f"settle -> replay of a waiting duplicate, {family}, {rounds} rounds each")
    for name, values in samples.items():
        values.sort()
        p95 = values[int(len(values) * 0.95) - 1]
        median = statistics.median(values)
        print(f"  {name:<8} median {median * 1000:7.2f} ms   p95 {p95 * 1000:7.2f} ms")
    ratio = statistics.median(samples["polling"]) / statistics.median(samples["woken"])
    print(f"  polling / woken (median): {ratio:.0f}x")
    report(
        "wake",
        f"{family}: settle -> replay of a waiting duplicate, ms (median)",
        statistics.median(samples["woken"]) * 1000,
        None,
        unit="ms",
        lower_is_better=True,
    )


if __name__ == "__main__":
    main()
