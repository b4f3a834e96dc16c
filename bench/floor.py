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

``--instructions`` counts instead, under callgrind, the client's instructions per call of
every path that a count can judge (`INSTRUCTIONS`): the Redis and PostgreSQL calls against
their baselines and peers, the HTTP requests against the bare endpoint, and observability.
The counts do not move with the machine's load, so a change can be judged on a busy
machine. The families left out are timings by nature (wrk, a waiting duplicate's latency,
growth, purge and the live calls during it, concurrency), and say so.

    .venv/bin/python bench/floor.py --instructions [--only redis,postgres]
    make bench-instructions                      (the same, after make bench's set-up)
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
# What `--instructions` runs per family: each script's callgrind mode. Redis takes a subset
# of its scenarios (about a minute each): its goals' paths and the peer with a goal.
INSTRUCTIONS: dict[str, list[str]] = {
    "redis": [
        "redis_store.py",
        "--instructions",
        "--only",
        "idempo,minimum,idempo_replay,minimum_replay,powertools,powertools_replay,"
        "idempo_cached_replay",
    ],
    "postgres": ["postgres_tx.py", "--instructions"],
    "asgi": FAMILIES["asgi"],
    "observe": [*FAMILIES["observe"], "--quick"],
}
# the families whose scripts take --quick
QUICK = {"redis", "postgres", "http", "growth", "rgrowth", "concurrency", "observe"}
# The program a family cannot run without; missing, the family is skipped, not failed
# (`make bench` installs wrk where apt can).
NEEDS = {"http": "wrk"}


def run_family(name: str, full: bool, report: Path, *, instructions: bool = False) -> int | str:
    """The family's exit status, or why it did not run."""
    if instructions:
        if name not in INSTRUCTIONS:
            return skipped(name, "not counted: it measures time by nature")
        script, *options = INSTRUCTIONS[name]
        needed: str | None = "valgrind"
    else:
        script, *options = FAMILIES[name]
        needed = NEEDS.get(name)
        if name in QUICK and not full:
            options.append("--quick")
    if needed is not None and shutil.which(needed) is None:
        return skipped(name, f"skipped: {needed} is not installed")
    command = [sys.executable, str(HERE / script), *options]
    print(f"\n=== {name}: {' '.join(command[1:])}", flush=True)
    env = {**os.environ, "IDEMPO_BENCH_REPORT": str(report)}
    return subprocess.run(command, env=env, check=False).returncode


def skipped(name: str, why: str) -> str:
    print(f"\n=== {name}: {why}", flush=True)
    return why


def verdict(row: dict[str, object]) -> str:
    goal, value = row["goal"], row["value"]
    if not isinstance(goal, int | float) or not isinstance(value, int | float):
        return ""
    met = value <= goal if row["lower_is_better"] else value >= goal
    return "met" if met else "MISSED"


def print_table(
    rows: list[dict[str, object]], failed: list[str], not_run: dict[str, str], title: str
) -> None:
    print(f"\n=== {title}")
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
    for name, why in not_run.items():
        print(f"{name:<12}{why}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--full", action="store_true", help="each family's long run")
    parser.add_argument("--only", help="families, comma-separated (default: all)")
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="client instructions per call under callgrind, for the paths a count can judge",
    )
    args = parser.parse_args()
    names = [name for name in (args.only or ",".join(FAMILIES)).split(",") if name]
    unknown = [name for name in names if name not in FAMILIES]
    if unknown:
        raise SystemExit(f"unknown families: {', '.join(unknown)} (known: {', '.join(FAMILIES)})")
    with tempfile.TemporaryDirectory(prefix="idempo-bench-") as tmp:
        report = Path(tmp) / "rows.jsonl"
        report.touch()
        status = {
            name: run_family(name, args.full, report, instructions=args.instructions)
            for name in names
        }
        rows = [json.loads(line) for line in report.read_text().splitlines()]
    failed = [name for name, code in status.items() if isinstance(code, int) and code != 0]
    not_run = {name: why for name, why in status.items() if isinstance(why, str)}
    title = "client instructions per call" if args.instructions else "distance to the floor"
    print_table(rows, failed, not_run, f"{title} (issue 15's goals)")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
