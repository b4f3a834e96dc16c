"""Microseconds and instructions per call of the function API, in process.

Each scenario runs ``with idem.once(key, ...)`` one fresh key after another, the block
doing nothing but setting its result (no business write), so what is measured is idempo's
own work per call plus the store's round trips:

    memory          `MemoryStore`
    sqlite          `SQLiteStore` on its own connection (leased)
    sqlite_tx       `SQLiteStore`, transactional on the app's ``sqlite3`` connection
    postgres        `PostgresStore` on its own pooled connections (leased)
    postgres_tx     `PostgresStore`, transactional on the app's psycopg connection
    *_replay        the same scenario, one completed key replayed on every call

    python bench/function_overhead.py [--calls N] [--only memory,sqlite] [--dsn URL]
    python bench/function_overhead.py --instructions     # callgrind: instructions/call

``--instructions`` runs each scenario under ``valgrind --tool=callgrind`` twice, with two
call counts, and reports the difference per call: deterministic however loaded the machine
is, and free of start-up costs (the client's, the server's are not counted at all). Run it
on the baseline tree with ``PYTHONPATH=/work/baseline/src``.
"""

from __future__ import annotations

import argparse
import secrets
import shutil
import sqlite3
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, closing
from pathlib import Path
from typing import Any

from idempo import Idempotency

sys.path.insert(0, str(Path(__file__).parent))
from _measure import callgrind_count, scratch_postgres_store  # the bench scripts' own

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/test"
BASES = ["memory", "sqlite", "sqlite_tx", "postgres", "postgres_tx"]
SCENARIOS = BASES + [f"{name}_replay" for name in BASES]

Call = Callable[[str], None]


def _guard(idem: Idempotency, conn: Any = None) -> Call:
    def call(key: str) -> None:
        with idem.once(key, operation="bench", payload={"n": 1}, conn=conn) as attempt:
            if not attempt.replayed:
                attempt.result = {"ok": True}

    return call


def _memory(_stack: ExitStack, _tmp: str, _dsn: str, _tx: bool) -> Call:
    from idempo.stores.memory import MemoryStore

    return _guard(Idempotency(MemoryStore()))


def _sqlite(stack: ExitStack, tmp: str, _dsn: str, tx: bool) -> Call:
    from idempo.stores.sqlite import SQLiteStore

    path = str(Path(tmp, "bench.db"))
    store = SQLiteStore(path)
    stack.callback(store.close)
    store.migrate()
    conn = stack.enter_context(closing(sqlite3.connect(path))) if tx else None
    return _guard(Idempotency(store), conn)


def _postgres(stack: ExitStack, _tmp: str, dsn: str, tx: bool) -> Call:
    import psycopg

    store = scratch_postgres_store(stack, dsn)
    conn = stack.enter_context(psycopg.connect(dsn)) if tx else None
    return _guard(Idempotency(store), conn)


BUILDERS = {
    "memory": (_memory, False),
    "sqlite": (_sqlite, False),
    "sqlite_tx": (_sqlite, True),
    "postgres": (_postgres, False),
    "postgres_tx": (_postgres, True),
}


def keys(name: str) -> Iterator[str]:
    if name.endswith("_replay"):
        while True:
            yield "replayed"
    while True:
        yield secrets.token_hex(8)


def run(name: str, calls: int, dsn: str, *, warmup: bool = True) -> float:
    """Seconds per call of ``name``, after a warm-up call (unless told otherwise)."""
    build, tx = BUILDERS[name.removesuffix("_replay")]
    with tempfile.TemporaryDirectory(prefix="idempo-fn-") as tmp, ExitStack() as stack:
        call = build(stack, tmp, dsn, tx)
        source = keys(name)
        if warmup or name.endswith("_replay"):
            call(next(source))  # a replay scenario's key is completed here
        start = time.perf_counter()
        for _ in range(calls):
            call(next(source))
        return (time.perf_counter() - start) / calls


def instructions(names: list[str], small: int, large: int, dsn: str) -> None:
    """Instructions per call under callgrind: (Ir at ``large`` - Ir at ``small``) / Δn."""
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise SystemExit("valgrind not found: apt-get install valgrind")
    print(f"{'scenario':<20}{'instr/call':>12}")
    for name in names:
        args = ["--only", name, "--dsn", dsn]
        counts = [
            callgrind_count(valgrind, __file__, [*args, "--calls", str(n)]) for n in (small, large)
        ]
        print(f"{name:<20}{(counts[1] - counts[0]) / (large - small):>12.0f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--calls", type=int, default=2000, help="calls per scenario")
    parser.add_argument("--only", help="comma-separated scenarios: " + ", ".join(SCENARIOS))
    parser.add_argument("--dsn", default=DEFAULT_DSN)
    parser.add_argument("--instructions", action="store_true", help="count with callgrind")
    parser.add_argument(
        "--counts",
        default="100,400",
        help="with --instructions: the two call counts whose difference is measured",
    )
    args = parser.parse_args()
    names = args.only.split(",") if args.only else SCENARIOS
    unknown = set(names) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenarios: {sorted(unknown)}")
    if args.instructions:
        small, large = (int(n) for n in args.counts.split(","))
        instructions(names, small, large, args.dsn)
        return
    for name in names:
        print(f"{name:<20}{run(name, args.calls, args.dsn) * 1e6:>10.1f} µs/call", flush=True)


if __name__ == "__main__":
    main()
