"""What encryption at rest costs per call: the function API with and without a `KeyRing`,
measured in the same run, on the memory store and on PostgreSQL.

Each scenario is ``with idem.once(key, ...)`` whose block sets a result of about
``--result-bytes`` of JSON; a fresh call seals it (one AES-256-GCM encryption, a random
nonce), a replay opens it (one decryption). Plain and encrypted runs alternate, round after
round, so both see the same machine; the figure kept for each is the median of its rounds.

    python bench/encryption_overhead.py [--calls N] [--rounds R] [--result-bytes B]
                                        [--only memory,postgres] [--dsn URL]
    python bench/encryption_overhead.py --instructions      # callgrind: instructions/call

It prints µs per call without and with encryption, the difference and the ratio. On a
shared machine the µs move with the load; ``--instructions`` counts this process's
instructions per call under ``valgrind --tool=callgrind`` instead (the difference between
two call counts, so start-up is not counted; PostgreSQL's own work is not counted at all),
which no load changes.
"""

from __future__ import annotations

import argparse
import secrets
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from idempo import Idempotency
from idempo.encryption import KeyRing, generate_key

sys.path.insert(0, str(Path(__file__).parent))
from _measure import callgrind_count, scratch_postgres_store  # the bench scripts' own

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/test"
STORES = ["memory", "postgres"]

Call = Callable[[str], None]


def _memory(_stack: ExitStack, _dsn: str) -> Any:
    from idempo.stores.memory import MemoryStore

    return MemoryStore()


BUILDERS = {"memory": _memory, "postgres": scratch_postgres_store}


def _call(idem: Idempotency, operation: str, result: dict[str, Any]) -> Call:
    def call(key: str) -> None:
        with idem.once(key, operation=operation, payload={"n": 1}) as attempt:
            if not attempt.replayed:
                attempt.result = result

    return call


def _keys(replay: bool) -> Iterator[str]:
    while True:
        yield "replayed" if replay else secrets.token_hex(8)


def _per_call(call: Call, calls: int, replay: bool) -> float:
    source = _keys(replay)
    call(next(source))  # warm-up; a replay scenario's key is completed here
    start = time.perf_counter()
    for _ in range(calls):
        call(next(source))
    return (time.perf_counter() - start) / calls


def _result(size: int) -> dict[str, Any]:
    return {"id": "ch_1", "status": "succeeded", "blob": "x" * max(0, size - 50)}


def _calls(stack: ExitStack, store_name: str, size: int, dsn: str) -> tuple[Call, Call]:
    """The plain call and the sealed one, on one store: two operations, since a sealed
    guard refuses the plain guard's records."""
    result = _result(size)
    store = BUILDERS[store_name](stack, dsn)
    plain = _call(Idempotency(store), "plain", result)
    sealed = _call(
        Idempotency(store, encryption=KeyRing({"bench": generate_key()})), "sealed", result
    )
    return plain, sealed


def _line(name: str, off: float, on: float, unit: str) -> None:
    print(
        f"{name:<18}{off:>10.1f}{on:>10.1f}{on - off:>+10.1f}{on / off:>9.2f}x {unit}", flush=True
    )


def measure(store_name: str, calls: int, rounds: int, size: int, dsn: str) -> None:
    with ExitStack() as stack:
        plain, sealed = _calls(stack, store_name, size, dsn)
        for replay in (False, True):
            times: dict[str, list[float]] = {"plain": [], "sealed": []}
            for _ in range(rounds):
                times["plain"].append(_per_call(plain, calls, replay))
                times["sealed"].append(_per_call(sealed, calls, replay))
            off, on = (statistics.median(times[name]) * 1e6 for name in ("plain", "sealed"))
            _line(f"{store_name}_{'replay' if replay else 'fresh'}", off, on, "µs")


def single(spec: str, calls: int, size: int, dsn: str) -> None:
    """One scenario (``store:fresh|replay:plain|sealed``) ``calls`` times: what callgrind
    runs."""
    store_name, scenario, variant = spec.split(":")
    with ExitStack() as stack:
        plain, sealed = _calls(stack, store_name, size, dsn)
        _per_call(sealed if variant == "sealed" else plain, calls, scenario == "replay")


def instructions(names: list[str], size: int, dsn: str, small: int, large: int) -> None:
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise SystemExit("valgrind not found: apt-get install valgrind")
    for store_name in names:
        for scenario in ("fresh", "replay"):
            per_call = []
            for variant in ("plain", "sealed"):
                spec = f"{store_name}:{scenario}:{variant}"
                args = ["--single", spec, "--result-bytes", str(size), "--dsn", dsn]
                counts = [
                    callgrind_count(valgrind, __file__, [*args, "--calls", str(n)])
                    for n in (small, large)
                ]
                per_call.append((counts[1] - counts[0]) / (large - small) / 1000)
            _line(f"{store_name}_{scenario}", *per_call, "k instructions")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--calls", type=int, default=2000, help="calls per round")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds per figure")
    parser.add_argument("--result-bytes", type=int, default=300, help="size of the result")
    parser.add_argument("--only", help="comma-separated stores: " + ", ".join(STORES))
    parser.add_argument("--dsn", default=DEFAULT_DSN)
    parser.add_argument("--instructions", action="store_true", help="count with callgrind")
    parser.add_argument("--counts", default="200,800", help="with --instructions: call counts")
    parser.add_argument("--single", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.single:
        single(args.single, args.calls, args.result_bytes, args.dsn)
        return
    names = args.only.split(",") if args.only else STORES
    unknown = set(names) - set(STORES)
    if unknown:
        parser.error(f"unknown stores: {sorted(unknown)}")
    print(f"{'scenario':<18}{'plain':>10}{'sealed':>10}{'delta':>10}{'ratio':>10}")
    if args.instructions:
        small, large = (int(n) for n in args.counts.split(","))
        instructions(names, args.result_bytes, args.dsn, small, large)
        return
    print(f"result of ~{args.result_bytes} bytes; µs per call, median of {args.rounds} rounds")
    for name in names:
        measure(name, args.calls, args.rounds, args.result_bytes, args.dsn)


if __name__ == "__main__":
    main()
