"""The async renewals of one event loop share one timer (`idempo._core.renewal._Wheel`):
each still renews on its own period, and a stopped one never renews again."""

from __future__ import annotations

import asyncio
import gc
import logging
import weakref

from idempo import Scope
from idempo._core.renewal import Renewal

STEP = 10.0  # the most a test waits, seconds


class _Attempt:
    def __init__(self, key: str) -> None:
        self.scope = Scope.of(key, operation="work")
        self.renewed: list[float] = []
        self.more = asyncio.Event()

    async def renew(self) -> None:
        self.renewed.append(asyncio.get_running_loop().time())
        self.more.set()


async def _renewed(attempt: _Attempt, times: int) -> None:
    while len(attempt.renewed) < times:
        attempt.more.clear()
        await asyncio.wait_for(attempt.more.wait(), STEP)


def test_renewals_of_several_periods_share_the_loops_timer() -> None:
    async def scenario() -> None:
        fast, slow, stopped = _Attempt("fast"), _Attempt("slow"), _Attempt("stopped")
        logger = logging.getLogger("test")
        renewals = [Renewal(fast, 0.01, logger), Renewal(slow, 0.03, logger)]
        gone = Renewal(stopped, 0.005, logger)
        for renewal in (*renewals, gone):
            renewal.start()
        await gone.stop()  # before its first renewal was due
        await _renewed(slow, 3)
        for renewal in renewals:
            await renewal.stop()
        assert not stopped.renewed
        # Each renewed on its own period: never sooner than it after the one before.
        assert len(fast.renewed) >= len(slow.renewed)
        for attempt, every in ((fast, 0.01), (slow, 0.03)):
            gaps = [b - a for a, b in zip(attempt.renewed, attempt.renewed[1:], strict=False)]
            assert all(gap >= every * 0.999 for gap in gaps), gaps
        count = len(fast.renewed)
        await asyncio.sleep(0.05)  # past several of its periods: nothing more comes
        assert len(fast.renewed) == count

    asyncio.run(scenario())


def test_the_wheel_lives_and_dies_with_its_loop() -> None:
    """A loop that renewed (one renewal left unstopped, even) is not kept alive by it."""
    loop = asyncio.new_event_loop()
    seen = weakref.ref(loop)

    async def scenario() -> None:
        Renewal(_Attempt("left"), 60.0, logging.getLogger("test")).start()

    loop.run_until_complete(scenario())
    loop.close()
    del loop
    gc.collect()
    assert seen() is None
