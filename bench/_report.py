"""The rows of `make bench`'s one table (bench/floor.py): each family script reports the paths
it measured, with the goal issue 15 sets beside each, and floor.py prints them together.

A script reports only when ``IDEMPO_BENCH_REPORT`` names a file (floor.py sets it); run on
its own, a script prints its own tables and nothing more.
"""

from __future__ import annotations

import json
import os


def report(
    family: str,
    path: str,
    value: float,
    goal: float | None,
    *,
    unit: str = "x",
    lower_is_better: bool = False,
    round_trips: float | None = None,
) -> None:
    """Add one measured path to the run's table (a JSON line appended to the report file)."""
    target = os.environ.get("IDEMPO_BENCH_REPORT")
    if not target:
        return
    row = {
        "family": family,
        "path": path,
        "value": value,
        "goal": goal,
        "unit": unit,
        "lower_is_better": lower_is_better,
        "round_trips": round_trips,
    }
    with open(target, "a", encoding="utf-8") as out:
        out.write(json.dumps(row) + "\n")


def report_instructions(family: str, top: str, bottom: str, counts: dict[str, float]) -> None:
    """Add a `--instructions` row: client instructions per call of ``top`` over ``bottom``'s
    (lower is better; the counts themselves in the path). No goal: issue 15 sets its goals
    on calls/s, and this row is how a change to them is judged on a busy machine."""
    ours, base = counts[top], counts[bottom]
    path = f"client instructions: {top} / {bottom} ({ours / 1000:.0f} k / {base / 1000:.0f} k)"
    report(family, path, ours / base, None, lower_is_better=True)
