"""`make bench`: every benchmark family in one run, and one table of each path against the
goal issue 15 sets for it (docs/benchmarks.md, "distance to the floor").

    .venv/bin/python bench/floor.py [--full] [--only FAMILY,...]  (families: see FAMILIES below)

Each family runs in a process of its own (bench/<script>.py, ``--quick`` unless ``--full``)
and prints its own tables as it goes; each reports its paths to this run's table
(bench/_report.py). ``asgi`` counts instructions under valgrind, which the machine's load
does not move; the others are ratios of calls/s measured in the same run, so read them on a
quiet machine. ``http`` serves the same app under uvicorn and drives it with wrk
(bench/asgi_middleware.py: idempo against the bare endpoint and the peer
asgi-idempotency-header, which only the bench dependency group installs). A family that
cannot run (a server down, valgrind missing) is said so and the rest go on; without wrk
the http family is skipped, which fails nothing. ``growth`` (PostgreSQL and MariaDB,
bench/sql_growth.py) and ``rgrowth`` (Redis, bench/redis_growth.py) load 10^5 records (10^6
with ``--full``) and report calls/s at that size over calls/s at 10^4, the purge's records/s
and the live calls' p99 while a purge runs. ``concurrency`` (bench/concurrency.py) grows
fresh calls from 1 to 64 clients in up to 8 processes, on PostgreSQL and Redis, and reports
what is left at 64 of the best level's calls/s, idempo's and the same load's by hand.
``observe`` (bench/observability_overhead.py, callgrind) counts what OpenTelemetryObserver
in its default state (the API alone, no SDK) adds to a call (issue 15 allows 2 %).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
FAMILIES: dict[str, list[str]] = {
    "redis": ["redis_store.py"],
    "postgres": ["postgres_tx.py"],
    "asgi": ["asgi_overhead.py", "--instructions", "--loop", "asyncio"],
    "http": ["asgi_middleware.py"],
    "wake": ["wake_latency.py"],
    # 10^5 records unless --full (10^6): loads, purges and the live calls during the purge
    "growth": ["sql_growth.py", "--store", "both", "--phases", "growth,purge,live"],
    "rgrowth": ["redis_growth.py"],
    # fresh calls/s from 1 to 64 clients in up to 8 processes, PostgreSQL and Redis
    "concurrency": ["concurrency.py"],
    # instructions per call with OpenTelemetryObserver in its default state (no SDK) / none
    "observe": ["observability_overhead.py"],
}
# the families whose scripts take --quick
QUICK = {"redis", "postgres", "http", "growth", "rgrowth", "concurrency", "observe"}
# The program a family cannot run without; missing, the family is skipped, not failed
# (`make bench` installs wrk where apt can).
NEEDS = {"http": "wrk"}


def run_family(name: str, full: bool, report: Path) -> int | None:
    """The family's exit status; None when it was skipped."""
    needed = NEEDS.get(name)
    if needed is not None and shutil.which(needed) is None:
        print(f"\n=== {name}: skipped ({needed} is not installed)", flush=True)
        return None
    command = [sys.executable, str(HERE / FAMILIES[name][0]), *FAMILIES[name][1:]]
    if name in QUICK and not full:
        command.append("--quick")
    print(f"\n=== {name}: {' '.join(command[1:])}", flush=True)
    env = {**os.environ, "IDEMPO_BENCH_REPORT": str(report)}
    return subprocess.run(command, env=env, check=False).returncode


def verdict(row: dict[str, object]) -> str:
    goal, value = row["goal"], row["value"]
    if not isinstance(goal, int | float) or not isinstance(value, int | float):
        return ""
    met = value <= goal if row["lower_is_better"] else value >= goal
    return "met" if met else "MISSED"


def print_table(rows: list[dict[str, object]], failed: list[str], skipped: list[str]) -> None:
    print("\n=== distance to the floor (issue 15's goals)")
    print(f"{'family':<12}{'path':<62}{'measured':>10}{'goal':>9}  {'':<7}{'round trips':>11}")
    for row in rows:
        goal = row["goal"]
        op = "<=" if row["lower_is_better"] else ">="
        goal_text = f"{op} {goal:g}" if isinstance(goal, int | float) else "-"
        trips = row["round_trips"]
        trips_text = f"{trips:.2f}" if isinstance(trips, int | float) else "-"
        value = row["value"]
        assert isinstance(value, int | float)
        print(
            f"{row['family']!s:<12}{row['path']!s:<62}{value:>9.2f}{row['unit']!s:<1}"
            f"{goal_text:>9}  {verdict(row):<7}{trips_text:>11}"
        )
    for name in failed:
        print(f"{name:<12}did not run to its end (see its output above)")
    for name in skipped:
        print(f"{name:<12}skipped: {NEEDS[name]} is not installed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--full", action="store_true", help="each family's long run")
    parser.add_argument("--only", default=",".join(FAMILIES), help="families, comma-separated")
    args = parser.parse_args()
    names = [name for name in args.only.split(",") if name]
    unknown = [name for name in names if name not in FAMILIES]
    if unknown:
        raise SystemExit(f"unknown families: {', '.join(unknown)} (known: {', '.join(FAMILIES)})")
    with tempfile.TemporaryDirectory(prefix="idempo-bench-") as tmp:
        report = Path(tmp) / "rows.jsonl"
        report.touch()
        status = {name: run_family(name, args.full, report) for name in names}
        rows = [json.loads(line) for line in report.read_text().splitlines()]
    failed = [name for name, code in status.items() if code not in (0, None)]
    skipped = [name for name, code in status.items() if code is None]
    print_table(rows, failed, skipped)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
