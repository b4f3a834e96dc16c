"""What the wake-up's mark costs a fresh guarded call on PostgreSQL (leased mode, the store's
own connections): the settle statement with its try-lock on the scope's advisory mark (and
no NOTIFY, since no one waits) against the same statement without it, measured in one run.

    .venv/bin/python bench/postgres_wake_cost.py [--calls 300] [--rounds 15] [--dsn URL]

Rounds alternate, in a random order, between two stores on scratch schemas that differ only
in the settle statement; each figure is the median of the rounds' µs per call. The stores'
sessions commit without waiting for the disk (``synchronous_commit=off``): a flush takes
milliseconds on a shared machine and would hide microseconds.
"""

from __future__ import annotations

import argparse
import random
import secrets
import statistics
import time
from contextlib import ExitStack
from functools import cached_property
from typing import Any

from _measure import scratch_postgres_store
from idempo import Idempotency
from idempo.stores._sql.dialect import FENCED_MARKER
from idempo.stores._sql.postgres import PostgresDialect
from idempo.stores.postgres import PostgresStore

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/test"


class UnmarkedDialect(PostgresDialect):
    """The settle statement as it was before the wake-up."""

    @cached_property
    def settle_sql(self) -> str:
        return (
            f"WITH settled AS ({self.settle_update} RETURNING token)"
            " SELECT CASE WHEN EXISTS (SELECT 1 FROM settled) THEN 1"
            f" WHEN EXISTS ({self.settled_sql}) THEN 1"
            f" ELSE CAST(concat('{FENCED_MARKER}: token ', :token, ' is stale') AS integer) END"
        )


class UnmarkedStore(PostgresStore):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.dialect = UnmarkedDialect(self.dialect.table)
        self._logic._dialect = self.dialect  # type: ignore[attr-defined]


def one_round(idem: Idempotency, calls: int) -> float:
    prefix = secrets.token_hex(4)
    started = time.perf_counter()
    for n in range(calls):
        with idem.once(f"{prefix}-{n}", operation="bench") as attempt:
            attempt.result = "done"
    return (time.perf_counter() - started) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--dsn", default=DEFAULT_DSN)
    args = parser.parse_args()
    dsn = f"{args.dsn}{'&' if '?' in args.dsn else '?'}options=-csynchronous_commit%3Doff"
    with ExitStack() as stack:
        faces = {
            "with the mark": Idempotency(scratch_postgres_store(stack, dsn)),
            "without": Idempotency(scratch_postgres_store(stack, dsn, UnmarkedStore)),
        }
        for idem in faces.values():
            one_round(idem, args.calls)  # warm up: connections, prepared statements
        samples: dict[str, list[float]] = {name: [] for name in faces}
        for _ in range(args.rounds):
            for name in random.sample(list(faces), len(faces)):
                samples[name].append(one_round(faces[name], args.calls))
    print(f"fresh guarded call, PostgreSQL leased, {args.rounds} rounds of {args.calls} calls")
    for name, values in samples.items():
        print(f"  {name:<14} median {statistics.median(values):7.1f} µs per call")
    marked, plain = (statistics.median(v) for v in samples.values())
    print(f"  difference: {marked - plain:+.1f} µs per call ({marked / plain - 1:+.1%})")


if __name__ == "__main__":
    main()
