"""Purging a store's expired records in batches, the loop of ``idempo purge``.

A batch is either a fixed number of records or, with a time budget (``batch_time``), as many
as the store deletes in about that long: each batch's size is estimated from the best of the
last few measured speeds (records/s). After each full batch the loop rests ``rest`` times as
long as the batch took, so that a long purge leaves the database, and a small machine's
cores, to live calls for that share of the time.

A store may declare the budget that suits it as ``purge_batch_time`` (seconds), the default
when none is given: short batches hold a row lock, a page or Redis's one thread for less
time at once, so a live call behind one waits less (docs/decisions.md, "Purge at scale").
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from datetime import datetime
from typing import Any

from .errors import ConfigurationError

BATCH = 1000
"""Records per batch without a time budget."""
MOST = 10_000
"""The most records a batch sized by time asks for, unless ``batch`` says otherwise: one
statement's locks and, on MariaDB, its key list stay bounded whatever a speed measured."""
FIRST = 100
"""The first batch sized by time, before any speed is known."""
SPEEDS = 8
"""How many of the last batches' speeds the next size is estimated from."""


def batch_seconds(text: str) -> float:
    """``--batch-time`` as seconds: ``0.005``, ``5ms`` or ``0.005s``; 0 turns the time budget
    off (fixed batches of ``--batch``).

    >>> batch_seconds("5ms"), batch_seconds("0.25"), batch_seconds("1s")
    (0.005, 0.25, 1.0)
    """
    raw = text.strip().lower()
    scale = 1.0
    if raw.endswith("ms"):
        raw, scale = raw[:-2], 0.001
    elif raw.endswith("s"):
        raw = raw[:-1]
    try:
        seconds = float(raw) * scale
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds < 0:
        raise ConfigurationError(
            f"--batch-time must be seconds (0.005, 0.005s) or milliseconds (5ms), at least 0;"
            f" got {text!r}"
        )
    return seconds


def store_batch_time(store: Any) -> float | None:
    """The time budget ``store`` declares for a purge batch (``purge_batch_time``), if any."""
    declared = getattr(store, "purge_batch_time", None)
    return float(declared) if isinstance(declared, int | float) and declared > 0 else None


class BatchSizer:
    """The size of the next batch for a time budget of ``batch_time`` seconds a batch.

    The best of the last `SPEEDS` speeds, not their mean or the last one: on a shared machine
    a batch is slowed by what else runs (another process on its core, a checkpoint), which
    says nothing of how many records the next batch can delete in its budget when it is not;
    the few recent ones follow a purge that really slows (a table that no longer fits the
    cache). A batch too fast for the clock to measure makes the next one twice as large.
    """

    def __init__(self, batch_time: float, first: int = FIRST, most: int = MOST) -> None:
        self.batch_time = batch_time
        self.most = most
        self.size = max(1, min(first, most))
        self.speeds: deque[float] = deque(maxlen=SPEEDS)

    def measured(self, deleted: int, seconds: float) -> None:
        if seconds <= 0:
            self.size = min(self.most, self.size * 2)
            return
        self.speeds.append(deleted / seconds)
        self.size = max(1, min(self.most, round(max(self.speeds) * self.batch_time)))


def purge_records(
    store: Any,
    *,
    batch: int | None = None,
    batch_time: float | None = None,
    before: datetime | None = None,
    rest: float = 1.0,
    sleep: Callable[[float], object] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    """Delete ``store``'s expired records in batches until one comes up short; returns how
    many.

    ``batch_time`` (seconds; default: the store's ``purge_batch_time``, else none) sizes each
    batch to take about that long, from `FIRST` records up to ``batch`` (default `MOST`);
    ``batch_time=0``, or no budget at all, deletes fixed batches of ``batch`` (default
    `BATCH`). After each full batch the loop rests ``rest`` times as long as it took;
    ``rest=0`` purges flat out. ``before``: records expired before it (default: the store's
    clock).

    >>> from idempo.stores.memory import MemoryStore
    >>> purge_records(MemoryStore(), rest=0)
    0
    """
    budget = store_batch_time(store) if batch_time is None else batch_time
    sizer = None
    if budget:
        sizer = BatchSizer(budget, most=MOST if batch is None else batch)
    size = BATCH if batch is None else batch
    total = 0
    while True:
        if sizer is not None:
            size = sizer.size
        started = clock()
        deleted = int(store.purge(before=before, limit=size))
        took = clock() - started
        total += deleted
        if deleted < size:
            return total
        if sizer is not None:
            sizer.measured(deleted, took)
        if rest > 0:
            sleep(rest * took)
