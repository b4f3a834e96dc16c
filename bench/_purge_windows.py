"""Live calls during a purge against live calls without one, measured in alternating windows.

A purge of 10^6 records lasts minutes; on a shared machine the load moves more than that in
minutes, so comparing the calls made during the purge with a few seconds of calls before and
after it measures the machine, not the purge. Here the purge runs the way ``idempo purge``
does (``purge_records``, with its rest between batches) but stops for a window of
``seconds`` after every ``seconds`` of purging: the live calls made in purging windows and in
the pauses between them then see the same load around them, and only the purge tells them
apart.

    windows = PurgeWindows(seconds=1.0)
    purged = purge_as_cli(store, batch=None, batch_time=None, rest=1.0, sleep=windows.sleep)
    windows.close()
    during, quiet = windows.split(samples)  # samples: (monotonic start, latency) per call

``time.monotonic`` is one clock for every process of the machine (Linux CLOCK_MONOTONIC), so
the samples may come from another process.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any


def purge_as_cli(
    store: Any,
    batch: int | None,
    batch_time: float | None,
    rest: float,
    sleep: Callable[[float], object] = time.sleep,
) -> int:
    """What ``idempo purge --batch B --batch-time T --rest R`` does with ``store``'s expired
    records, in whichever idempo is installed: its loop with batches sized by time
    (idempo._purge), or the older one of fixed batches (``idempo.cli.purge_records``)."""
    try:
        from idempo._purge import purge_records
    except ImportError:  # main before idempo._purge: fixed batches, the loop in the CLI
        if batch_time:
            raise SystemExit("this idempo has no --batch-time") from None
        from idempo.cli import purge_records  # type: ignore[attr-defined,no-redef,unused-ignore]

        return int(purge_records(store, batch=batch or 1000, rest=rest, sleep=sleep))
    return int(purge_records(store, batch=batch, batch_time=batch_time, rest=rest, sleep=sleep))


class PurgeWindows:
    """``sleep`` for ``purge_records``: its rest, then, once ``seconds`` of purging have
    passed, a pause as long; the spans (start, stop, purging) it went through."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.since = time.monotonic()
        self.spans: list[tuple[float, float, bool]] = []

    def sleep(self, rest: float) -> None:
        time.sleep(rest)
        now = time.monotonic()
        if now - self.since >= self.seconds:
            self.spans.append((self.since, now, True))
            time.sleep(self.seconds)
            self.since = time.monotonic()
            self.spans.append((now, self.since, False))

    def close(self) -> None:
        """End the last purging span (the purge returned)."""
        self.spans.append((self.since, time.monotonic(), True))

    def purging_seconds(self) -> float:
        return sum(stop - start for start, stop, purging in self.spans if purging)

    def split(self, samples: Iterable[tuple[float, float]]) -> tuple[list[float], list[float]]:
        """The latencies of the calls that started in a purging span, and in a pause."""
        during: list[float] = []
        quiet: list[float] = []
        spans = sorted(self.spans)
        i = 0
        for at, latency in sorted(samples):
            while i < len(spans) and spans[i][1] <= at:
                i += 1
            if i < len(spans) and spans[i][0] <= at:
                (during if spans[i][2] else quiet).append(latency)
        return during, quiet
